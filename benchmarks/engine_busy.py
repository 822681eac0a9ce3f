"""Where an Engine run's time goes: wall against GPU busy time (union of kernel intervals) and its idle gaps by size,
kernel time by kind, and the host time of each runner path (graph replays, packed-step graphs, eager forwards).

Usage: python benchmarks/engine_busy.py [MODEL [SCALE [WORKLOADS [GREEDY_RING [STEPS_AHEAD]]]]]  (llama-1b 1 a,b 16 2)
Each workload runs twice after the throughput benchmark's warm-up: unprofiled (wall, % of floor), then under the
CUDA profiler. The profiled run is also split at the end of its last prefill-attention kernel: the prefill phase
(prompts still arriving in chunks, decodes riding along) and the decode phase, each with its span, busy time, idle
gaps and kernel time by kind. JSON to $OUT (or .).
"""

import collections
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug.bench import shapes, timing, workloads  # noqa: E402
from llmplug.bench.throughput import _drop, run_offline, warm_up  # noqa: E402
from llmplug.bench.workloads import ModelCost  # noqa: E402
from llmplug.engine import packed_graphs, runner  # noqa: E402

KINDS = (("cublas", ("gemm", "cutlass", "sm90", "nvjet")), ("prefill_attn", ("prefill_attention",)),
         ("decode_attn", ("decode_attn",)), ("gemv", ("gemv",)), ("rope_store", ("rope", "store_kv")),
         ("norm", ("norm",)), ("act", ("act",)), ("copy", ("memcpy", "memset", "copy")))


def kind(name: str) -> str:
    name = name.lower()
    return next((k for k, keys in KINDS if any(key in name for key in keys)), "other")


def phases(kernels) -> dict:
    """The kernels before and after the end of the last prefill-attention kernel: span (first start to last end),
    busy and idle (:func:`~llmplug.bench.timing.busy_and_gaps`) and kernel seconds by kind, per phase."""
    prefill = [e.time_range.start + e.device_time for e in kernels if kind(e.name) == "prefill_attn"]
    split = max(prefill, default=float("-inf"))
    out = {}
    for label, part in (("prefill", [e for e in kernels if e.time_range.start < split]),
                        ("decode", [e for e in kernels if e.time_range.start >= split])):
        if not part:
            continue
        busy, gaps = timing.busy_and_gaps(part)
        by_kind = collections.Counter()
        for e in part:
            by_kind[kind(e.name)] += e.device_time * 1e-6
        span = (max(e.time_range.start + e.device_time for e in part) - min(e.time_range.start for e in part)) * 1e-6
        out[label] = {"span_s": span, "busy_s": busy, "gaps": {k: gaps[k] for k in ("all", ">= 0.1 ms", ">= 1 ms")},
                      "largest_gaps": gaps["largest"], "kernel_s_by_kind": dict(by_kind.most_common())}
    return out


def timed(host, calls, owner, name, label):
    def record(seconds):
        host[label] += seconds
        calls[label] += 1

    timing.time_calls(owner, name, record)


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    scale = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    keys = sys.argv[3].split(",") if len(sys.argv) > 3 else ["a", "b", "c"]
    ring = int(sys.argv[4]) if len(sys.argv) > 4 else llmplug.EngineConfig.greedy_ring
    ahead = int(sys.argv[5]) if len(sys.argv) > 5 else llmplug.EngineConfig.steps_ahead
    torch.manual_seed(0)
    model = shapes.build(name, torch.bfloat16, "cuda")
    cost, ceil = ModelCost.of(model), timing.ceilings("cuda")
    llmplug.optimize(model)
    vocab = model.config.vocab_size
    wls = {k: workloads.build(k, vocab, scale) for k in keys}
    config = llmplug.EngineConfig(greedy_ring=ring, steps_ahead=ahead)
    print(f"warm-up {warm_up(model, config, list(wls.values()), vocab):.1f} s", flush=True)
    host, calls = collections.defaultdict(float), collections.Counter()
    for path in ("_replay_uniform", "_replay_prefill", "_forward"):
        timed(host, calls, runner.ModelRunner, path, path)
    timed(host, calls, packed_graphs.PackedGraphs, "run", "packed graphs")
    out = {"model": name, "scale": scale, "gpu": torch.cuda.get_device_name(), "ceilings": ceil, "runs": {}}
    for key, wl in wls.items():
        engine = llmplug.Engine(model, config)
        rec = run_offline(engine, wl, cost, ceil)
        _drop(engine)
        gc.collect()
        host.clear()
        calls.clear()
        engine = llmplug.Engine(model, config)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            profiled = run_offline(engine, wl, cost, ceil)
            torch.cuda.synchronize()
        _drop(engine)
        gc.collect()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy, gaps = timing.busy_and_gaps(kernels)
        by_kind, by_name = collections.Counter(), collections.Counter()
        for e in kernels:
            by_kind[kind(e.name)] += e.device_time * 1e-6
            by_name[e.name[:60]] += e.device_time * 1e-6
        run = {"wall_s": rec["wall_s"], "fraction_of_floor": rec["fraction_of_floor"],
               "floor_s": rec["floor"]["floor_s"], "profiled_wall_s": profiled["wall_s"],
               "gpu_busy_s": busy, "gpu_idle_gaps": gaps,
               "steps": rec["stats"].get("steps"), "ring_steps": rec["stats"].get("ring_steps"),
               "phases": phases(kernels), "kernel_s_by_kind": dict(by_kind.most_common()),
               "kernel_s_top": dict(by_name.most_common(12)),
               "host_s_by_path": {p: {"calls": calls[p], "host_s": host[p]} for p in calls}}
        out["runs"][key] = run
        print(key, json.dumps({k: v for k, v in run.items() if k != "kernel_s_top"}, default=str), flush=True)
    path = Path(os.environ.get("OUT", "."), f"engine_busy_{name}_{scale:g}_ring{ring}.json")
    path.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
