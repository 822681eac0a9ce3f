"""The Engine's host time per step, by phase, on a throughput workload: how long the host spends scheduling, building,
launching and resolving a step, and how long it waits for the GPU (``HostRead.values``). ``perf_counter`` wrappers, no
profiler. In ``stub`` mode the model's step returns zeros at once, so what is left is the host alone.

With ``--heads`` every eager lm_head call of a packed step is listed as (rows, ms, GPU stream idle after it): a call
that waits for the queued GPU work stalls the step-ahead pipeline.

Usage: python benchmarks/engine_phases.py [--model llama-1b|tiny] [--workloads a,b] [--modes real,stub] [--heads]
``tiny`` is a one-layer llama (vocab 512) for the CPU, stub mode only. JSON to $OUT (or .).
"""

import argparse
import collections
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug.bench import shapes, timing, workloads  # noqa: E402
from llmplug.bench.throughput import _drop, _greedy, warm_up  # noqa: E402
from llmplug.engine import engine as engine_mod  # noqa: E402
from llmplug.engine import host_read, packed_graphs, runner, scheduler  # noqa: E402
from llmplug.patches import decoder  # noqa: E402

ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


class Phases:
    """Seconds per wrapped call site, summed and worst, over one run."""

    def __init__(self) -> None:
        self.total, self.worst = collections.defaultdict(float), collections.defaultdict(float)

    def wrap(self, owner, name: str, label: str | None = None) -> None:
        label = label or name

        def record(seconds):
            self.total[label] += seconds
            self.worst[label] = max(self.worst[label], seconds)

        timing.time_calls(owner, name, record)


class GcPauses:
    """Python's garbage collections during a run (``gc.callbacks``): count by generation, total and worst pause."""

    def __init__(self) -> None:
        self.counts, self.total, self.worst, self._start = collections.Counter(), 0.0, 0.0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        self.counts[info["generation"]] += 1
        self.total += pause
        self.worst = max(self.worst, pause)

    def report(self) -> dict:
        out = {"by_generation": dict(sorted(self.counts.items())), "total_ms": 1e3 * self.total,
               "worst_ms": 1e3 * self.worst}
        self.counts.clear()
        self.total = self.worst = 0.0
        return out


def log_heads(calls: list) -> None:
    """Record each eager lm_head matmul of a packed step (the graphs' own are captured, never called)."""
    matmul = decoder.Dense.matmul

    def logged(self, x, *args, **kwargs):
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return matmul(self, x, *args, **kwargs)
        t0 = time.perf_counter()
        out = matmul(self, x, *args, **kwargs)
        calls.append((x.shape[0], round(1e3 * (time.perf_counter() - t0), 2), torch.cuda.current_stream().query()))
        return out

    decoder.Dense.matmul = logged


def build(name: str, device: str) -> torch.nn.Module:
    if name != "tiny":
        return shapes.build(name, torch.bfloat16 if device == "cuda" else torch.float32, device)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config).to(device).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workloads", default="a")
    p.add_argument("--modes", default="real,stub")
    p.add_argument("--heads", action="store_true")
    args = p.parse_args()
    phases, heads = Phases(), []
    E = engine_mod.Engine
    for owner, name in [(E, "_step"), (E, "_resolve"), (E, "_execute"), (E, "_sample_rows"), (E, "_advance"),
                        (E, "_fill_placeholders"), (scheduler.Scheduler, "schedule"), (host_read.HostRead, "values"),
                        (runner.ModelRunner, "step"), (runner.ModelRunner, "_replay_uniform"),
                        (getattr(engine_mod, "PageTable", None), "rows"), (packed_graphs.PackedGraphs, "run"),
                        (decoder.FusedDecoder, "head")]:
        if owner is not None:  # (older trees, for A/Bs, lack some)
            phases.wrap(owner, name, f"{owner.__name__}.{name}")
    phases.wrap(engine_mod, "build_step")
    if args.heads:
        log_heads(heads)
    torch.manual_seed(0)
    model = build(args.model, args.device)
    llmplug.optimize(model, **({"kv_num_blocks": 40000} if args.model == "tiny" else {}))
    vocab = model.config.vocab_size
    wls = {k: workloads.build(k, vocab, 1.0) for k in args.workloads.split(",")}
    config = llmplug.EngineConfig()
    out = {"model": args.model, "device": args.device, "warmup_s": warm_up(model, config, list(wls.values()), vocab)}
    cuda = args.device == "cuda"
    gc_pauses = GcPauses()
    for mode in args.modes.split(","):
        if mode == "stub":
            def zeros(self, ctx, _v=vocab, _d=model.dtype):
                rows = ctx.input_ids.shape[0] if ctx.logits_indices is None else ctx.logits_indices.shape[0]
                return torch.zeros(rows, _v, device=ctx.input_ids.device, dtype=_d)

            runner.ModelRunner.step = zeros
        for key, wl in wls.items():
            engine = llmplug.Engine(model, config)
            steps, step = [0], engine._step

            def counted(step=step, steps=steps):
                steps[0] += 1
                return step()

            engine._step = counted
            phases.total.clear()
            phases.worst.clear()
            heads.clear()
            gc_pauses.report()  # from here on
            stats = (lambda: torch.cuda.memory_stats()) if cuda else (lambda: {})
            before = stats()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.generate(wl.prompts, [_greedy(n) for n in wl.output_lens], progress=False)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            row = {"wall_s": wall, "steps": steps[0],
                   "ms_per_step": {k: 1e3 * v / steps[0] for k, v in phases.total.items()},
                   "worst_ms": {k: 1e3 * v for k, v in phases.worst.items()}, "gc": gc_pauses.report(),
                   "allocator": {k: stats().get(k, 0) - before.get(k, 0) for k in ALLOCATOR} if cuda else {}}
            if args.heads and mode == "real":
                row["heads"] = list(heads)
            out[f"{mode}_{key}"] = row
            print(f"{mode} {key}: wall {wall:.3f} s, {steps[0]} steps; ms/step "
                  + " ".join(f"{k}={v:.3f}" for k, v in sorted(row["ms_per_step"].items(), key=lambda kv: -kv[1]))
                  + f"; gc {row['gc']}", flush=True)
            if row.get("heads"):
                print(f"  lm_head calls (rows, ms, stream idle after): {row['heads']}", flush=True)
            _drop(engine)
            del engine
            gc.collect()
    path = Path(os.environ.get("OUT", ".")) / f"engine_phases_{args.model}_{args.workloads.replace(',', '')}.json"
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
