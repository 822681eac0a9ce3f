"""Where a speculative ``generate`` step's time goes on CUDA: wall time per step against the GPU's busy time, and the
host's heaviest Python functions and launches (issue 23: the verify step costs ~1.09x a decode step on the GPU, the
measured step ~1.28x).

Oracle proposer at ``--alpha`` on the decisive random-weight shape (:mod:`llmplug.bench.spec`), one profiled call per
batch after a warm-up.

    python benchmarks/spec_profile.py --model llama-8b --batches 1 8 --draft-shape llama-1b --out profile.json
"""

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug.bench import timing  # noqa: E402
from llmplug.bench.shapes import build  # noqa: E402
from llmplug.bench.spec import OracleProposer, decisive  # noqa: E402
from llmplug.engine.sequences import SequenceBatch  # noqa: E402
from llmplug.engine.step import build_step  # noqa: E402
from llmplug.spec.proposers import DraftModelProposer  # noqa: E402
from llmplug.state import state_of  # noqa: E402


def _gpu_busy_us(prof) -> float:
    """Union of the CUDA kernels' and copies' intervals (us)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, -1.0
    for s, e in spans:
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def speculative_call(model, b: int, alpha: float, k: int, new_tokens: int, draft=None):
    """A warmed-up speculative ``generate`` of ``b`` rows (the oracle's drafts, the draft model's cost when given)."""
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (b, 128), generator=torch.Generator().manual_seed(b)).cuda()
    gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    ref = model.generate(**gen).tolist()

    def call():
        pay = None
        if draft is not None:  # the draft model's real cost, the oracle's drafts
            pay = DraftModelProposer(SequenceBatch(state_of(draft).runner, ids, None, 128 + new_tokens + k,
                                                   prefix_cache=False))
        return model.generate(**gen, assistant_model=OracleProposer(ref, alpha, vocab, seed=b, pay_for=pay),
                              num_assistant_tokens=k)

    call()
    torch.cuda.synchronize()
    return call


def profile_batch(model, b: int, alpha: float, call, draft=None) -> dict:
    """Wall time of ``call`` unprofiled, then under torch's profiler (GPU busy time, host ops) and cProfile."""
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps = llmplug.spec_stats(model).steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    busy = _gpu_busy_us(prof)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    pr = cProfile.Profile()
    pr.enable()
    call()
    torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    ours = sorted(((v[2], v[3], k[0].split("llmplug/")[-1] + ":" + k[2], v[1]) for k, v in st.stats.items()
                   if "llmplug/" in k[0]), reverse=True)[:20]
    out = {"batch": b, "alpha": alpha, "draft": draft is not None, "wall_ms": wall * 1e3, "steps": steps,
           "wall_per_step_ms": wall * 1e3 / steps,
           "gpu_busy_ms_profiled": busy / 1e3,
           "host_ops": [(e.key, e.count, e.self_cpu_time_total / e.count) for e in ops],
           "python": [(name, calls, tot * 1e3, cum * 1e3) for tot, cum, name, calls in ours]}
    label = " with the draft model" if draft is not None else ""
    print(f"\nbatch {b}{label}: {wall * 1e3:.1f} ms wall (unprofiled), {steps} steps, "
          f"{wall * 1e3 / steps:.3f} ms a step; profiled GPU busy {busy / 1e3:.1f} ms", flush=True)
    print("  host ops (self cpu us/call x calls):")
    for key, count, per in out["host_ops"]:
        print(f"    {key[:60]:60s} {per:8.1f} x {count}")
    print("  llmplug python (tottime ms, cumtime ms, calls):")
    for name, calls, tot, cum in out["python"]:
        print(f"    {name[:70]:70s} {tot:8.2f} {cum:8.2f} {calls}")
    return out


def graph_latency(model, repeats: int = 50) -> list[dict]:
    """For every captured graph of the runner: the GPU time of one replay (events around back-to-back replays), the
    host time of ``replay()`` itself, and the serial time of ``replay(); synchronize()`` (what a step costs when the
    host must read its result before launching the next one)."""
    runner = state_of(model).runner
    out = []
    for key, (graph, _) in list(runner._graphs.items()):
        gpu = timing.replay_seconds(graph, repeats, warmup=1) * 1e3
        launch = serial = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            graph.replay()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            launch += t1 - t0
            serial += t2 - t0
        row = {"graph": str(key), "gpu_ms": gpu, "launch_ms": launch * 1e3 / repeats,
               "serial_ms": serial * 1e3 / repeats}
        print(f"  graph {row['graph']:24s} gpu {gpu:.3f} ms, replay() {row['launch_ms']:.3f} ms on the host, "
              f"replay + sync {row['serial_ms']:.3f} ms", flush=True)
        out.append(row)
    return out


def kernel_breakdown(model, rows: int, queries=(1, 5), repeats: int = 5) -> dict:
    """GPU time per kernel name of one eager uniform step of ``rows`` rows and ``q`` tokens each, for each ``q``
    (graphs off: the same kernels the graphs replay, each traced)."""
    runner = state_of(model).runner
    ids = torch.randint(3, model.config.vocab_size, (rows, 128), generator=torch.Generator().manual_seed(7)).cuda()
    batch = SequenceBatch(runner, ids, None, max_length=160, prefix_cache=False)
    out = {}
    allowed, runner._graphs_allowed = runner._graphs_allowed, False
    try:
        batch.prefill()
        for q in queries:
            batch._grow(range(rows), [s.num_computed + q for s in batch.seqs])
            ctx = build_step(batch.seqs, [q] * rows, batch.block_size, ids.device,
                             input_ids=torch.zeros(rows * q, dtype=torch.long), block_tables=batch.block_table_dev,
                             all_logits=True)
            runner.step(ctx)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(repeats):
                    runner.step(ctx)
                torch.cuda.synchronize()
            kernels = {}
            for e in prof.key_averages():
                if e.device_time_total > 0:
                    kernels[e.key] = kernels.get(e.key, 0.0) + e.device_time_total / repeats
            total = sum(kernels.values())
            out[q] = {"total_us": total, "kernels": sorted(kernels.items(), key=lambda kv: -kv[1])[:14]}
            print(f"  rows {rows}, q {q}: {total:.0f} us of kernels a step", flush=True)
            for name, us in out[q]["kernels"]:
                print(f"    {us:8.1f} us  {name[:90]}")
    finally:
        runner._graphs_allowed = allowed
        batch.release()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--draft-shape", help="also profile this draft model shape's real cost (oracle drafts)")
    ap.add_argument("--draft-batches", nargs="+", type=int, default=[1])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = llmplug.optimize(decisive(build(args.model, torch.bfloat16, "cuda")))
    draft = None
    cases = [(b, None) for b in args.batches]
    if args.draft_shape:
        torch.manual_seed(1)
        draft = llmplug.optimize(build(args.draft_shape, torch.bfloat16, "cuda"))
        cases += [(b, draft) for b in args.draft_batches]
    calls = [speculative_call(model, b, args.alpha, args.k, args.new_tokens, d) for b, d in cases]
    print("\ngraphs:")  # before any profiling: once the profiler has run, every launch costs the host far more
    graphs = graph_latency(model) + (graph_latency(draft) if draft is not None else [])
    rows = [profile_batch(model, b, args.alpha, call, d) for (b, d), call in zip(cases, calls)]
    print("\nkernels of an eager step:")
    kernels = {b: kernel_breakdown(model, b) for b in args.batches}
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "device": torch.cuda.get_device_name(), "rows": rows,
                                        "graphs": graphs, "kernels": kernels}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
