"""Time ``llmplug.ops.fused_gemm`` configurations against what the fused decoder runs today, per projection group of a
decoder layer at a decode step's row counts (GPU only).

Groups (1B shapes by default; ``--hidden/--inter/--qkv``):

* ``qkv``: today ``add_rms_norm`` + ``F.linear``; fused: the norm in the GEMM (the add moved to the o/down epilogue).
* ``o`` / ``down``: today ``F.linear``; fused: the GEMM with the residual add in its epilogue.
* ``gate_up``: today ``add_rms_norm`` + ``F.linear`` + ``act_and_mul``; fused: norm, GEMM and SiLU-and-mul in one.

Each variant runs in a CUDA graph over ``--copies`` rotating weight sets (larger than L2 together) under programmatic
launch, as in a captured decode step; every configuration's output is checked against the reference and for
run-to-run equality. Prints the best configurations and a per-layer total; ``--out`` writes all timings as JSON.

    python benchmarks/fused_gemm_probe.py --rows 128 --out probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from llmplug.bench.timing import graph_time
from llmplug.ops import fused_gemm as fg
from llmplug.ops._triton import programmatic_launch
from llmplug.ops.act_mul import act_and_mul
from llmplug.ops.rms_norm import add_rms_norm

EPS = 1e-5


def configs(n_out: int, k: int, gated: bool, rows: int):
    """Candidate ``(BLOCK_N, BLOCK_K, splits, warps, stages)`` with 32-400 programs."""
    for bn, bk, splits in itertools.product((32, 64, 128) if not gated else (32, 64), (64, 128), (1, 2, 4, 8)):
        programs = -(-n_out // bn) * splits
        if not 32 <= programs <= 400 or k // splits < 2 * bk:
            continue
        warps = 8 if bn == 128 or (gated and bn == 64) or rows > 128 else 4
        yield bn, bk, splits, warps, 3 if bk == 128 else 4


def group_fns(name: str, rows: int, hidden: int, n: int, k: int, copies: int, dt):
    """``(weights, baseline(w), fused(w, config), reference(w), n_out)`` of one group over ``copies`` weight sets."""
    dev = "cuda"
    x = torch.randn(rows, k, device=dev, dtype=dt)
    res = torch.randn(rows, hidden, device=dev, dtype=dt)
    ws = [(torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5, torch.rand(k, device=dev, dtype=dt) + 0.5)
          for _ in range(copies)]
    if name in ("qkv", "gate_up"):
        gated = "silu" if name == "gate_up" else ""
        h = torch.randn(rows, k, device=dev, dtype=dt)

        def base(w):
            normed, _ = add_rms_norm(x, h, w[1], EPS)
            y = F.linear(normed, w[0])
            return act_and_mul(y, gated) if gated else y

        def fused(w, cfg):
            return fg.fused_gemm(x, w[0], w[1], EPS, gated=gated, config=cfg)

        def ref(w):
            return fg.fused_gemm_ref(x, w[0], w[1], EPS, gated=gated)
        return ws, base, fused, ref, n // 2 if gated else n, bool(gated)

    def base(w):
        return F.linear(x, w[0])

    def fused(w, cfg):
        return fg.fused_gemm(x, w[0], residual=res, config=cfg)

    def ref(w):
        return fg.fused_gemm_ref(x, w[0], residual=res)
    return ws, base, fused, ref, n, False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[128])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=8192)
    ap.add_argument("--qkv", type=int, default=3072)
    ap.add_argument("--copies", type=int, default=12)
    ap.add_argument("--groups", nargs="+", default=["qkv", "o", "gate_up", "down"])
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    fg.counters("cuda")
    shapes = {"qkv": (args.qkv, args.hidden), "o": (args.hidden, args.hidden),
              "gate_up": (2 * args.inter, args.hidden), "down": (args.hidden, args.inter)}
    results: dict = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, "runs": []}
    summary = []
    for rows in args.rows:
        total_base = total_best = 0.0
        for name in args.groups:
            n, k = shapes[name]
            ws, base, fused, ref, n_out, gated = group_fns(name, rows, args.hidden, n, k, args.copies, dt)
            with programmatic_launch():
                t_base = graph_time(base, ws) * 1e6
            best = (float("inf"), None)
            for cfg in configs(n_out, k, gated, rows):
                t0 = time.perf_counter()
                try:
                    with programmatic_launch():
                        a, b = fused(ws[0], cfg), fused(ws[0], cfg)
                        torch.cuda.synchronize()
                        err = (a.float() - ref(ws[0]).float()).abs().max().item()
                        t = graph_time(lambda w, c=cfg, f=fused: f(w, c), ws) * 1e6
                except Exception as e:  # noqa: BLE001 - a configuration that does not compile is reported, not fatal
                    print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                same = torch.equal(a, b)
                results["runs"].append({"rows": rows, "group": name, "config": cfg, "us": t, "max_err": err,
                                        "deterministic": same, "baseline_us": t_base,
                                        "compile_s": time.perf_counter() - t0})
                ok = same and err < 0.05 * max(1.0, ref(ws[0]).float().abs().max().item())
                print(f"  {rows} {name} {cfg}: {t:.2f} us (today {t_base:.2f}) err {err:.3g} det {same}", flush=True)
                if ok and t < best[0]:
                    best = (t, cfg)
            summary.append((rows, name, t_base, *best))
            total_base += t_base
            total_best += best[0]
        summary.append((rows, "layer", total_base, total_best, None))
    print("\n| rows | group | today us | fused best us | config (BN, BK, splits, warps, stages) |")
    print("| ---: | --- | ---: | ---: | --- |")
    for rows, name, tb, tf, cfg in summary:
        print(f"| {rows} | {name} | {tb:.2f} | {tf:.2f} | {cfg} |")
    results["summary"] = summary
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
