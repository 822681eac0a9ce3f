"""The down projection at decode sizes: cuBLAS's split-K (its own reduce kernel) against a batched GEMM over K slices
whose fp32 partials the next layer's add + RMSNorm sums. (GPU only.)

At 128 rows the 1B model's down projection (N 2048, K 8192) runs through a split-K kernel and ``splitKreduce_kernel``,
~16 us for 33.5 MB of weights (8 us of reading at the H200's 4.19 TB/s; BENCHMARKS.md, "cuBLASLt's other
algorithms"). Here, chains of ``--layers`` (distinct weights) down projections each followed by add + RMSNorm, timed
per layer in a CUDA graph:

* ``linear``: ``F.linear`` then llmplug's ``add_rms_norm`` (today's step);
* ``tuned``: the cuBLASLt algorithm ``tuned_gemm.tune`` picks, then ``add_rms_norm``;
* ``bmm S``: :func:`~llmplug.ops.ksplit_gemm.ksplit_matmul` (``torch.bmm`` of the ``S`` K slices with fp32 output
  ``(S, M, N)``), then :func:`~llmplug.ops.rms_norm.parts_add_rms_norm`, which sums the partials in order, rounds the
  sum to bf16 (what a GEMM's output is) and does the add + norm.

Each variant's output is compared with ``linear``'s (max abs difference of the normed rows). ``--gemm-only`` times
the products alone.

    python benchmarks/splitk_down_probe.py --out splitk.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from llmplug.bench.timing import replay_seconds
from llmplug.ops import tuned_gemm
from llmplug.ops._triton import programmatic_launch
from llmplug.ops.ksplit_gemm import ksplit_matmul
from llmplug.ops.rms_norm import add_rms_norm, parts_add_rms_norm


def chain(rows: int, weights: list, variant: str, gemm_only: bool, choice=None):
    dev, dt = "cuda", torch.bfloat16
    n, k = weights[0].shape
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(rows, k, device=dev, dtype=dt, generator=g)
    res = torch.randn(rows, n, device=dev, dtype=dt, generator=g)
    nw = torch.rand(n, device=dev, dtype=dt, generator=g) + 0.5

    def step():
        y = None
        for w in weights:
            if variant == "linear" or variant == "tuned":
                h = (tuned_gemm.matmul(choice, x, w) if variant == "tuned" else None)
                h = F.linear(x, w) if h is None else h
                y = h if gemm_only else add_rms_norm(h, res, nw, 1e-5)[0]
            else:
                parts = ksplit_matmul(x, w, int(variant.split()[1]))
                y = parts if gemm_only else parts_add_rms_norm(parts, res, nw, 1e-5)[0]
        return y

    with programmatic_launch():
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = step()
    us = replay_seconds(graph, replays=30, warmup=3) * 1e6 / len(weights)
    graph.replay()
    return us, y.clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 64, 256])
    ap.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--shapes", nargs="+", default=["2048x8192"], help="N x K of the weights (1B down: 2048x8192)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--gemm-only", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "layers": args.layers, "gemm_only": args.gemm_only, "runs": []}
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(args.layers)]
        for rows in args.rows:
            choice = tuned_gemm.tune({(n, k): weights}, rows).get((n, k))
            variants = ["linear"] + (["tuned"] if choice is not None else [])
            variants += [f"bmm {s}" for s in args.splits if k % (8 * s) == 0]
            base = None
            for variant in variants + ["linear"]:  # linear again last: drift
                us, y = chain(rows, weights, variant, args.gemm_only, choice)
                if args.gemm_only and y.dim() == 3:
                    y = y.sum(0).to(torch.bfloat16)
                diff = None if base is None else (y.float() - base.float()).abs().max().item()
                base = y if base is None else base
                report["runs"].append({"shape": [n, k], "rows": rows, "variant": variant, "us_per_layer": us,
                                       "max_abs_diff": diff})
                print(f"{shape:10s} rows {rows:4d}  {variant:8s} {us:7.2f} us a layer  max |diff| vs linear {diff}",
                      flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
