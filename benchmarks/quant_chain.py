"""One-token projections of the 8B shape as a decode step runs them: CUDA-graph chains of launches with programmatic
dependent launch, over rotating weight copies larger than L2 together. Each kernel's ramp-up overlaps its
predecessor's tail as in a step, which isolated timings (``quant_sweep.py``) miss.

    python benchmarks/quant_chain.py out.json [--methods bf16 int8 int4] [--configs]

``--configs`` also times the int4 GEMV configs in ``INT4_GEMV`` (checked against the reference).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.ops._triton import programmatic_launch  # noqa: E402
from llmplug.ops.gemv import gemv  # noqa: E402
from llmplug.ops.w4_linear import w4_linear, w4_linear_ref  # noqa: E402
from llmplug.ops.w8_linear import w8_linear  # noqa: E402
from llmplug.quant.formats import quantize_int4, quantize_int8, sqnr_db  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
INT4_GEMV = [(1, bn, gps, warps, 1, 1) for bn, gps, warps in
             [(8, 4, 4), (16, 4, 4), (8, 8, 4), (16, 8, 4), (16, 8, 8), (32, 4, 8), (4, 8, 4)]]
CHAIN_BYTES = 400_000_000  # weight bytes a chain cycles through (8x an H100's L2)


def chain_us(fn, copies: list, launches: int = 64) -> float:
    """Microseconds a launch of ``fn(copy)`` in a captured chain of ``launches`` (best of 3 x 10 replays)."""
    with programmatic_launch():
        for c in copies:
            fn(c)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(launches):
                fn(copies[i % len(copies)])
    graph.replay()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (10 * launches))
    return best


def weights(method: str, n: int, k: int, count: int) -> tuple[list, int]:
    """``count`` random weight copies in ``method``'s format and the bytes one reads."""
    w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
    if method == "bf16":
        return w, 2 * n * k
    if method == "int8":
        return [quantize_int8(x) for x in w], n * k + 4 * n
    return [quantize_int4(x, 128) for x in w], n * k // 2 + 4 * n * (k // 128)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--methods", nargs="*", default=["bf16", "int8", "int4"])
    ap.add_argument("--configs", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    run = {"bf16": lambda x, c, **kw: gemv(x, c), "int8": lambda x, c, **kw: w8_linear(x, *c),
           "int4": lambda x, c, config=None: w4_linear(x, *c, 128, config=config)}
    rows = []
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for method in args.methods:
            copies, nbytes = weights(method, n, k, max(4, CHAIN_BYTES // (n * k)))
            configs = [None] + (INT4_GEMV if args.configs and method == "int4" else [])
            for config in configs:
                row = dict(shape=name, method=method, config=config)
                if config is not None:
                    row["sqnr_db"] = sqnr_db(w4_linear_ref(x, *copies[0], 128), run[method](x, copies[0], config))
                fn = run[method]
                row["us"] = chain_us(lambda c, fn=fn, x=x, config=config: fn(x, c, config=config), copies)
                row["tb_per_s"] = nbytes / row["us"] / 1e6
                rows.append(row)
                print(f"{name:8s} {method:5s} {str(config or 'default'):22s} {row['us']:7.2f} us "
                      f"{row['tb_per_s']:5.2f} TB/s", flush=True)
            del copies
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
