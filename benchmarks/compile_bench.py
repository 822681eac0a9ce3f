"""Stock HF ``generate(cache_implementation="static", compile_config=CompileConfig(backend=B))`` for each backend B,
one process, the same random weights (issue 25): compile warm-up (the first call), median decode tok/s at ``--batch``,
a decode step's time (the difference of a long and a 2-token call), the tokens (every backend must give the
default's), llmplug's match report, the host time a decode step spends inside the compiled call (Dynamo's guards and
bytecode, the backend's launch) and the step with Dynamo's guard evaluation skipped (what the guards cost), and with
``--profile`` a decode step under torch's profiler (a separate run: timings after it are not trusted): the GPU's busy
time (kernels overlapping under programmatic launch counted once), the kernels by name and torch.compile's host ranges.

    python benchmarks/compile_bench.py --model llama-8b --out results.json [--batch 4] [--profile] [--rounds 5]
        [--backends inductor llmplug llmplug_trees]

``--rounds N`` then times the backends alternately, N rounds of one call each, every backend compiled once in the one
process (no Dynamo reset between them, so the later backends' warm-ups are a warm process's): the ratio's median over
rounds, which the host's drift between timings moves less than one timing each (BENCHMARKS.md, "First session of
2026-12-01").
"""

import argparse
import hashlib
import json
import os
import statistics
import time

import torch
import transformers
from transformers import CompileConfig

import llmplug.inductor
from llmplug.bench.shapes import build, weight_bytes
from llmplug.bench.timing import ceilings, profile_steps, sync, time_call


def llmplug_trees(gm, example_inputs, **kwargs):
    """``--backends llmplug_trees``: llmplug's passes under Inductor's CUDA-graph trees instead of the backend's own
    graphs (the A/B of :mod:`llmplug.inductor.cuda_graphs`)."""
    os.environ["LLMPLUG_CUDAGRAPH_TREES"] = "1"
    try:
        return llmplug.inductor.llmplug_backend(gm, example_inputs, **kwargs)
    finally:
        del os.environ["LLMPLUG_CUDAGRAPH_TREES"]


def compiled_call_host_ms(model, gen: dict, steps: int) -> float:
    """Median host ms of one call of the compiled forward over a ``steps``-token generate (no sync: the GPU runs on)."""
    original, samples = model.get_compiled_call, []

    def timed_get(config):
        fn = original(config)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            samples.append(time.perf_counter() - t0)
            return out
        return timed

    model.get_compiled_call = timed_get
    try:
        model.generate(**gen, max_new_tokens=steps)
    finally:
        del model.get_compiled_call
    return 1e3 * statistics.median(samples)


def alternate(model, ids, compiled: dict, rounds: int, new_tokens: int) -> dict:
    """Each backend's compiled call (as HF's ``get_compiled_call`` keeps it) timed in turn, ``rounds`` times: tok/s by
    backend and round, and each backend's median ratio over rounds against the first backend's."""
    tok_s = {backend: [] for backend in compiled}
    for _ in range(rounds):
        for backend, (call, config) in compiled.items():
            model._compiled_call, model._last_compile_config = call, config
            gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       cache_implementation="static", compile_config=config)
            t = time_call(lambda gen=gen: model.generate(**gen, max_new_tokens=new_tokens), "cuda", repeats=1,
                          warmup=0)
            tok_s[backend].append(ids.shape[0] * new_tokens / t["median"])
    first = next(iter(compiled))
    ratios = {b: statistics.median(x / y for x, y in zip(v, tok_s[first], strict=True)) for b, v in tok_s.items()}
    return {"tok_s": tok_s, "median_ratio": ratios}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--backends", nargs="+", default=["inductor", "llmplug"])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1, help="prompts a call (2-8: llmplug's skinny GEMV)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--rounds", type=int, default=0, help="then time the backends alternately, this many rounds")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    llmplug.inductor.register()
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "llmplug_trees" not in _BACKENDS:
        register_backend(name="llmplug_trees")(llmplug_trees)
    torch.manual_seed(0)
    model = build(args.model, torch.bfloat16, "cuda")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    ids = torch.randint(3, model.config.vocab_size, (args.batch, 128),
                        generator=torch.Generator().manual_seed(1)).cuda()
    ceil = ceilings("cuda")
    report = {"model": args.model, "batch": args.batch, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "transformers": transformers.__version__, "ceilings": ceil,
              "weight_bytes": weight_bytes(model), "rows": []}
    first, compiled = None, {}
    for backend in args.backends:
        if not args.rounds:
            torch._dynamo.reset()
        llmplug.inductor.reset_report()
        gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                   cache_implementation="static", compile_config=CompileConfig(backend=backend))
        row = {"backend": backend}
        if args.profile:
            prof = profile_steps(lambda steps, gen=gen: model.generate(**gen, max_new_tokens=steps), long=34)
            row["gpu_busy_us_per_step"] = prof["gpu_busy"]
            row["kernels_us_per_step"], row["host_us_per_step"] = prof["kernels"], prof["host"]
        else:
            t0 = time.perf_counter()
            out = model.generate(**gen, max_new_tokens=args.new_tokens)
            sync("cuda")
            row["warmup_s"] = time.perf_counter() - t0
            t = time_call(lambda gen=gen: model.generate(**gen, max_new_tokens=args.new_tokens), "cuda",
                          repeats=args.repeats, warmup=1)
            row["tok_s"] = args.batch * args.new_tokens / t["median"]
            # a decode step alone: the per-call costs (prefill, the graph recorded per call) cancel out
            short = time_call(lambda gen=gen: model.generate(**gen, max_new_tokens=2), "cuda", repeats=args.repeats)
            row["call_overhead_ms"] = 1e3 * short["median"]
            row["step_ms"] = 1e3 * (t["median"] - short["median"]) / (args.new_tokens - 2)
            row["compiled_call_host_ms"] = compiled_call_host_ms(model, gen, args.new_tokens)
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):  # diagnostic only
                unguarded = time_call(lambda gen=gen: model.generate(**gen, max_new_tokens=args.new_tokens), "cuda",
                                      repeats=args.repeats)
            row["step_ms_no_guards"] = 1e3 * (unguarded["median"] - short["median"]) / (args.new_tokens - 2)
            # a step reads the weights once whatever the batch: per call (as users see it) and per decode step
            read_s = report["weight_bytes"] / ceil["read_bytes_per_s"]
            row["fraction_of_roofline"] = row["tok_s"] / args.batch * read_s
            row["step_fraction_of_roofline"] = 1e3 * read_s / row["step_ms"]
            row["tokens_sha"] = hashlib.sha1(out.cpu().numpy().tobytes()).hexdigest()[:12]
            first = out if first is None else first
            row["identical_to_first"] = torch.equal(out, first)
            if hasattr(model, "_compiled_call"):  # HF's cache of its compiled call (transformers 5.x)
                compiled[backend] = (model._compiled_call, model._last_compile_config)
        row["matches"] = llmplug.inductor.report()
        report["rows"].append(row)
        brief = {k: v for k, v in row.items() if k not in ("kernels_us_per_step", "host_us_per_step")}
        print(json.dumps(brief), flush=True)
    if args.rounds and not args.profile:
        if len(compiled) != len(args.backends):
            raise RuntimeError("--rounds needs HF's cached compiled call (model._compiled_call), which this "
                               f"transformers {transformers.__version__} does not keep")
        report["rounds"] = alternate(model, ids, compiled, args.rounds, args.new_tokens)
        print("alternating rounds:", json.dumps(report["rounds"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    base = report["rows"][0]
    for row in report["rows"]:
        if args.profile:
            print(f"\n{row['backend']}: GPU busy {row['gpu_busy_us_per_step']:.0f} us a decode step "
                  f"({sum(row['kernels_us_per_step'].values()):.0f} us of kernel durations); host ranges, us a step:")
            for name, us in row["host_us_per_step"].items():
                print(f"  {us:8.1f}  {name[:110]}")
            print("  the top 25 kernels:")
            for name, us in list(row["kernels_us_per_step"].items())[:25]:
                print(f"  {us:8.1f}  {name[:110]}")
        else:
            print(f"{row['backend']:10s} warm-up {row['warmup_s']:6.1f} s  {row['tok_s']:7.1f} tok/s "
                  f"({row['tok_s'] / base['tok_s']:.2f}x, {row['fraction_of_roofline']:.1%} of the read roofline) "
                  f"step {row['step_ms']:.3f} ms ({base['step_ms'] / row['step_ms']:.2f}x; "
                  f"{row['step_ms_no_guards']:.3f} without guards; compiled call's host "
                  f"{row['compiled_call_host_ms']:.3f} ms)  "
                  f"same tokens: {row['identical_to_first']}  matches {row['matches']}")


if __name__ == "__main__":
    main()
