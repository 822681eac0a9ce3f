"""Timing helpers and the measured hardware ceilings (read bandwidth, bf16 matmul rate)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], device, repeats: int = 3, warmup: int = 1) -> dict:
    """Wall time of ``fn`` (synchronized): median, p50/p95/p99 and all samples, in seconds."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t0)
    q = sorted(samples)
    pick = lambda f: q[min(len(q) - 1, int(round(f * (len(q) - 1))))]  # noqa: E731
    return {"median": statistics.median(q), "p50": pick(0.5), "p95": pick(0.95), "p99": pick(0.99), "samples": q}


def time_calls(owner, name: str, record: Callable[[float], None]) -> None:
    """Wrap ``owner.name`` (a function of a module or class) so that each call reports its host seconds to ``record``
    (benchmarks that split a run's host time by call site)."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record(time.perf_counter() - t0)

    setattr(owner, name, timed)


def graph_time(fn: Callable[[torch.Tensor], object], copies: list, reps: int = 8, replays: int = 5) -> float:
    """Seconds per call of ``fn(w)``, replayed as one CUDA graph of ``reps`` passes over the rotating ``copies``.

    No launch overhead and, with copies larger than L2 together, no cache reuse: what a kernel costs inside a
    captured decode step.
    """
    for w in copies:
        fn(w)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for w in copies:
                fn(w)
    g.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(replays):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e-3 / (replays * reps * len(copies))


def replay_seconds(graph: torch.cuda.CUDAGraph, replays: int = 100, warmup: int = 5) -> float:
    """Seconds one replay of a captured CUDA graph takes, back to back (CUDA events around ``replays`` replays)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e-3


def kernels_by_name(fn: Callable[[], object], per: int = 1) -> dict[str, float]:
    """GPU time of each kernel name over one call of ``fn`` (profiled, synchronized), in us divided by ``per`` (the
    steps the call ran), largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] = totals.get(e.name, 0.0) + e.device_time / per
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def busy_and_gaps(events, largest: int = 8, bucket_ms: float = 50.0) -> tuple[float, dict]:
    """Seconds the GPU ran any kernel (the union of the kernels' intervals), and its idle gaps between the first and
    last kernel by size: ``{">= 0.1 ms": (count, s), ">= 1 ms": (count, s), "all": (count, s), "largest": [(ms into
    the run, gap ms, the kernel before, the kernel after), ...], "idle_ms_by_bucket": [idle ms in each ``bucket_ms``
    of the run, by where each gap starts]}``."""
    spans = sorted((e.time_range.start, e.time_range.start + e.device_time, e.name) for e in events)
    total, lo, hi, last, gaps = 0.0, None, None, "", []
    for s, e, name in spans:
        if hi is None or s > hi:
            if hi is not None:
                total += hi - lo
                gaps.append((s - hi, hi, last, name))
            lo, hi, last = s, e, name
        elif e > hi:
            hi, last = e, name
    total += 0 if hi is None else hi - lo
    sizes = [g[0] for g in gaps]
    by_size = {label: (len(g), sum(g) * 1e-6) for label, g in (
        ("all", sizes), (">= 0.1 ms", [g for g in sizes if g >= 100]), (">= 1 ms", [g for g in sizes if g >= 1000]))}
    first = spans[0][0] if spans else 0
    by_size["largest"] = [(round((at - first) * 1e-3, 2), round(g * 1e-3, 3), before[:50], after[:50])
                          for g, at, before, after in sorted(gaps, reverse=True)[:largest]]
    buckets = [0.0] * (int((hi - first) * 1e-3 // bucket_ms) + 1 if spans else 0)
    for g, at, _, _ in gaps:
        buckets[int((at - first) * 1e-3 // bucket_ms)] += g * 1e-3
    by_size["idle_ms_by_bucket"] = [round(b, 2) for b in buckets]
    return total * 1e-6, by_size


def profile_steps(fn: Callable[[int], object], long: int, short: int = 2) -> dict:
    """One decode step of ``fn(steps)`` (a generate of ``steps`` new tokens), profiled: the difference of a ``long``
    and a ``short`` call over ``long - short``, so prefill and per-call costs cancel. Returns us a step: ``gpu_busy``
    (the union of the kernels' intervals: kernels that overlap under programmatic launch count once), ``kernels``
    (by name, summed durations, largest first) and ``host`` (torch.compile's profiler ranges on the CPU by name:
    Dynamo's cache lookup, the compiled graph's call, ...)."""
    from torch.profiler import ProfilerActivity, profile

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def one(steps: int) -> tuple[float, dict, dict]:
        fn(steps)
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(steps)
            sync(device)
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        names: dict[str, float] = {}
        for e in kernels:
            names[e.name] = names.get(e.name, 0.0) + e.device_time
        host: dict[str, float] = {}
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and any(k in e.name for k in _COMPILE_RANGES):
                host[e.name] = host.get(e.name, 0.0) + e.cpu_time_total
        return 1e6 * busy_and_gaps(kernels)[0], names, host

    (busy_l, names_l, host_l), (busy_s, names_s, host_s) = one(long), one(short)
    per = long - short

    def diff(a: dict, b: dict) -> dict:
        return dict(sorted(((k, (v - b.get(k, 0.0)) / per) for k, v in a.items()), key=lambda kv: -kv[1]))

    return {"gpu_busy": (busy_l - busy_s) / per, "kernels": diff(names_l, names_s), "host": diff(host_l, host_s)}


# torch.compile's own profiler ranges (record_function names) that profile_steps reports
_COMPILE_RANGES = ("Dynamo", "Compiled", "Pregraph", "AOT", "CUDAGraph", "cudagraph", "Torch-Compiled")


def ceilings(device: str) -> dict:
    """Measured read bandwidth (bytes/s) and bf16 matmul rate (FLOP/s) on ``device`` (CUDA only)."""
    if torch.device(device).type != "cuda":
        return {}
    import triton.testing

    x = torch.randn(2 * 1024**3 // 2, dtype=torch.bfloat16, device=device)  # 2 GiB, far past L2
    read = triton.testing.do_bench(lambda: x.sum(dtype=torch.float32), warmup=50, rep=300, return_mode="median")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return {"read_bytes_per_s": 2 * 1024**3 / (read * 1e-3), "bf16_flops_per_s": 2 * 8192**3 / (mm * 1e-3)}
