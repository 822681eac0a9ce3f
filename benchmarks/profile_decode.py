"""Where a batch-1 decode step's time goes: graph replay alone vs the whole generate step, and each kernel's share
of the graph replay's critical path (torch.profiler).

    python benchmarks/profile_decode.py llama-8b [--batch 1] [--quantize int4]
"""

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug.bench.shapes import build, weight_bytes  # noqa: E402
from llmplug.bench.timing import replay_seconds  # noqa: E402
from llmplug.state import state_of  # noqa: E402


@torch.inference_mode()
def main(name: str, batch: int = 1, quantize: str | None = None, profile_host: bool = False) -> None:
    model = build(name, torch.bfloat16, "cuda")
    llmplug.optimize(model, quantize=quantize)
    ids = torch.randint(3, 1000, (batch, 128), device="cuda")
    model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    runner = state_of(model).runner
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(input_ids=ids, max_new_tokens=256, do_sample=False)
    torch.cuda.synchronize()
    step = (time.perf_counter() - t0) / 256
    sample = dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9)
    model.generate(input_ids=ids, max_new_tokens=8, **sample)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(input_ids=ids, max_new_tokens=256, eos_token_id=None, **sample)
    torch.cuda.synchronize()
    sampled = (time.perf_counter() - t0) / 256
    t0 = time.perf_counter()
    for _ in range(10):
        model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) / 10
    bucket = runner.graph_bucket(batch)  # plain greedy generate replays the greedy graph (decode + token choice)
    graph, buf = runner._graphs.get(("greedy", bucket)) or runner._graphs[("step", bucket, 1)]
    buf["positions"][:batch] = 200
    replay = replay_seconds(graph)
    wb = weight_bytes(model)
    print(f"{name} {quantize or 'bf16'} b{batch}: generate step {step * 1e3:.3f} ms, "
          f"graph replay {replay * 1e3:.3f} ms, weights {wb / 1e9:.2f} GB -> {wb / replay / 1e12:.2f} TB/s in replay")
    glue = (256 * step - first - 255 * replay) / 255
    print(f"generate with one new token (set-up + prefill) {first * 1e3:.2f} ms; per decode step outside the graph "
          f"{glue * 1e6:.0f} us; sampled generate step (temperature 0.7, top-k 50, top-p 0.9) {sampled * 1e3:.3f} ms")
    if profile_host:
        import cProfile
        import pstats

        with cProfile.Profile() as host:
            model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
            torch.cuda.synchronize()
        pstats.Stats(host).sort_stats("cumulative").print_stats(30)
    rows = graph_critical_path(graph, model.config.num_hidden_layers)
    print(f"kernels on the graph's critical path ({sum(r[1] for r in rows):.0f} launches, "
          f"{sum(r[2] for r in rows) / 1e3:.3f} ms a replay; name#i: the i-th of that kernel's calls in a layer)")
    for label, n, us in rows[:24]:
        print(f"  {us:8.1f} us {n:4d}x {us / n:7.2f} us/launch  {label}")


def graph_critical_path(graph: torch.cuda.CUDAGraph, layers: int, replays: int = 20) -> list[tuple[str, int, float]]:
    """Each kernel's share of one graph replay: ``(label, launches, us)`` a replay, largest first.

    Under programmatic dependent launch a kernel starts before its predecessor ends, so its own duration counts time
    spent waiting; instead each kernel is charged the time from the latest end of the kernels before it to its own
    end (what the step would lose without it). Kernels called ``c * layers`` times a step (plus a remainder) are told
    apart by call order within a layer: ``name#0..#c-1``, and ``name#tail`` for the calls after the last layer's.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per_step = len(kernels) // replays
    names = [e.name[:60] for e in kernels[:per_step]]
    calls = {n: names.count(n) for n in names}
    seen: dict[str, int] = defaultdict(int)
    labels = []
    for n in names:
        c = calls[n] // layers
        i = seen[n]
        seen[n] += 1
        labels.append(n if c == 0 else f"{n}#{i % c}" if i < c * layers else f"{n}#tail")
    cost: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for r in range(replays):
        step = kernels[r * per_step:(r + 1) * per_step]
        done = step[0].time_range.start
        for label, e in zip(labels, step):
            cost[label][0] += 1
            cost[label][1] += e.time_range.end - done
            done = max(done, e.time_range.end)
    return sorted(((k, n // replays, us / replays) for k, (n, us) in cost.items()), key=lambda r: -r[2])

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("shape")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quantize", choices=("int8", "int4", "fp8"))
    ap.add_argument("--profile-host", action="store_true", help="cProfile one generate call of one new token")
    args = ap.parse_args()
    main(args.shape, args.batch, args.quantize, args.profile_host)
