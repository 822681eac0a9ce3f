"""Few-row linears (a verify step at batch 1, decode at batch 2-8) on the 8B shapes: cuBLAS (``F.linear``), the
one-row GEMV and :mod:`llmplug.ops.skinny_gemv` over a grid of launch configs; microseconds and GB/s of weight read.

    python benchmarks/skinny_sweep.py --rows 1 2 4 5 8 --out results.json
"""

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.ops.gemv import gemv  # noqa: E402
from llmplug.ops.skinny_gemv import skinny_gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
CONFIGS = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((16, 32, 64), (128, 256), (4,), (3, 4, 6))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 5, 8])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        gb = n * k * 2 / 1e9
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "rows": m, "cublas_us": triton.testing.do_bench(partial(F.linear, x, w)) * 1e3}
            if m == 1:
                row["gemv_us"] = triton.testing.do_bench(partial(gemv, x, w)) * 1e3
            best = None
            ref = F.linear(x.float(), w.float())
            for cfg in CONFIGS:
                try:
                    out = skinny_gemv(x, w, config=cfg)
                    err = (out.float() - ref).abs().max().item()
                    t = triton.testing.do_bench(partial(skinny_gemv, x, w, config=cfg)) * 1e3
                except Exception as e:  # noqa: BLE001 (a config may not compile: report it)
                    print(f"{name} m{m} {cfg}: {type(e).__name__}", flush=True)
                    continue
                if best is None or t < best[1]:
                    best = (cfg, t, err)
            row.update(skinny_best_config=best[0], skinny_us=best[1], skinny_max_abs_err=best[2])
            for key in ("cublas_us", "gemv_us", "skinny_us"):
                if key in row:
                    row[key.replace("_us", "_gbs")] = gb / (row[key] * 1e-6)
            results.append(row)
            print(f"{name:8s} m{m}: cuBLAS {row['cublas_us']:7.1f} us ({row['cublas_gbs']:6.0f} GB/s)  skinny "
                  f"{row['skinny_us']:7.1f} us ({row['skinny_gbs']:6.0f} GB/s) {best[0]}"
                  + (f"  gemv {row['gemv_us']:7.1f} us" if m == 1 else ""), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
