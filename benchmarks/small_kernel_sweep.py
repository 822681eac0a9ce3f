"""Launch configurations of the decode step's residual add + RMSNorm at a serving batch (GPU only), timed behind the
cuBLAS o projection that feeds it (weights rotating over ``--copies`` sets), in one CUDA graph under programmatic
launch, minus the GEMM alone; SiLU-and-mul behind gate/up at its default configuration for scale.

    python benchmarks/small_kernel_sweep.py --rows 128 --out sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from llmplug.bench.timing import graph_time
from llmplug.ops import act_mul, rms_norm
from llmplug.ops._triton import next_pow2, programmatic_launch


def sweep(rows: int, hidden: int, inter: int, copies: int) -> list[dict]:
    """Every (rows a program, warps) of ``add_rms_norm``, the default, and ``act_and_mul``'s default: us a call."""
    dt, dev = torch.bfloat16, "cuda"
    w_o = [torch.randn(hidden, hidden, device=dev, dtype=dt) / hidden ** 0.5 for _ in range(copies)]
    w_gu = [torch.randn(2 * inter, hidden, device=dev, dtype=dt) / hidden ** 0.5 for _ in range(copies)]
    g = torch.rand(hidden, device=dev, dtype=dt) + 0.5
    x = torch.randn(rows, hidden, device=dev, dtype=dt)
    res = torch.randn(rows, hidden, device=dev, dtype=dt)

    def gemm(w):
        return F.linear(x, w)

    def normed(w):
        return rms_norm.add_rms_norm(F.linear(x, w), res, g, 1e-5)

    def gated(w):
        return act_mul.act_and_mul(F.linear(x, w))

    default, out = rms_norm._launch_config, []
    with programmatic_launch():
        o_alone, gu_alone = graph_time(gemm, w_o) * 1e6, graph_time(gemm, w_gu) * 1e6
        ref = normed(w_o[0])
        for per, warps in itertools.product((1, 2, 4), (2, 4, 8, 16)):
            rms_norm._launch_config = lambda k, p=per, wp=warps: (next_pow2(k), p, wp)
            same = all(torch.equal(a, b) for a, b in zip(normed(w_o[0]), ref))
            out.append({"kernel": "add_rms_norm", "rows_per_program": per, "warps": warps,
                        "us": graph_time(normed, w_o) * 1e6 - o_alone, "same": same})
            print(out[-1], flush=True)
        rms_norm._launch_config = default
        out.append({"kernel": "add_rms_norm", "config": "default", "us": graph_time(normed, w_o) * 1e6 - o_alone})
        out.append({"kernel": "act_and_mul", "config": "default", "us": graph_time(gated, w_gu) * 1e6 - gu_alone,
                    "gate_up_gemm_us": gu_alone, "o_gemm_us": o_alone})
        print(out[-2:], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=8192)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = sweep(args.rows, args.hidden, args.inter, args.copies)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": args.rows, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
