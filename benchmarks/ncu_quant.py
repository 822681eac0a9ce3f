"""One call of each batch-1 quantized projection kernel of the 8B shape, for Nsight Compute.

Only the calls between ``cudaProfilerStart`` and ``cudaProfilerStop`` are profiled (compilation and warm-up are
outside), so run it as

    ncu --profile-from-start off --clock-control none --section WarpStateStats ... \
        python benchmarks/ncu_quant.py [--methods int4 int8 bf16]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.ops.gemv import gemv  # noqa: E402
from llmplug.ops.w4_linear import w4_linear  # noqa: E402
from llmplug.ops.w8_linear import w8_linear  # noqa: E402
from llmplug.quant.formats import quantize_int4, quantize_int8  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", nargs="*", default=["int4", "int8", "bf16"])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    args = ap.parse_args()
    calls = []
    for name in args.shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        if "int4" in args.methods:
            q4 = quantize_int4(w, 128)
            calls.append((f"int4 {name}", lambda x=x, q4=q4: w4_linear(x, *q4, 128)))
        if "int8" in args.methods:
            q8 = quantize_int8(w)
            calls.append((f"int8 {name}", lambda x=x, q8=q8: w8_linear(x, *q8)))
        if "bf16" in args.methods:
            calls.append((f"bf16 {name}", lambda x=x, w=w: gemv(x, w)))
    for _, fn in calls:  # compile and warm up outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, fn in calls:
        torch.cuda.nvtx.range_push(label)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(label for label, _ in calls))


if __name__ == "__main__":
    main()
