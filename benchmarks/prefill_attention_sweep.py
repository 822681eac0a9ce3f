"""Prefill attention's launch config (BLOCK_M, BLOCK_N, warps, stages) at the Engine's packed-step shapes: GPU time in a
CUDA graph against the default (``_launch_config``), as a share of the measured bf16 matmul ceiling. Configs whose
output differs from the default's beyond bf16 noise, or that fail to launch, are listed as such.

Usage: python benchmarks/prefill_attention_sweep.py OUT.json   (CUDA; JSON written after every shape)
"""

import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.bench import timing  # noqa: E402
from llmplug.ops import prefill_attention as pmod  # noqa: E402

PAGE, HEADS, KV_HEADS = 16, 32, 8
SHAPES = [  # (name, new tokens per sequence, context per sequence)
    ("one 4096 chunk", [4096], [0]),
    ("2048 after 2048", [2048], [2048]),
    ("8 x 512 prompts", [512] * 8, [0] * 8),
]
CONFIGS = [(m, n, w, s) for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)) if m % n == 0]


def inputs(news, ctxs, d, dev="cuda"):
    t = sum(news)
    q = torch.randn(t, HEADS, d, dtype=torch.bfloat16, device=dev)
    k = torch.randn(t, KV_HEADS, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    pages = [-(-c // PAGE) for c in ctxs]
    kc = torch.randn(sum(pages) + 1, PAGE, KV_HEADS, d, dtype=torch.bfloat16, device=dev)
    vc = torch.randn_like(kc)
    width = max(max(pages), 1)
    tables = torch.zeros(len(news), width, dtype=torch.int32, device=dev)
    at = 0
    for b, n in enumerate(pages):
        tables[b, :n] = torch.arange(at, at + n, dtype=torch.int32)
        at += n
    cu = torch.tensor([0] + list(itertools.accumulate(news)), dtype=torch.int32, device=dev)
    ctx = torch.tensor(ctxs, dtype=torch.int32, device=dev)
    return q, k, v, kc, vc, tables, cu, ctx, max(news)


def flops(news, ctxs, d):
    return sum(4 * HEADS * d * (n * c + n * (n + 1) / 2) for n, c in zip(news, ctxs))


def main():
    out, ceil, rows = Path(sys.argv[1]), timing.ceilings("cuda"), []
    default = pmod._launch_config
    for d, (name, news, ctxs) in itertools.product((64, 128), SHAPES):
        args = inputs(news, ctxs, d)
        o = torch.empty_like(args[0])
        scale = d ** -0.5

        def call(_, args=args, scale=scale, o=o):
            return pmod.prefill_attention(*args, scale, out=o)

        want = pmod.prefill_attention(*args, scale).float()
        base = timing.graph_time(call, [None])
        res = []
        for cfg in CONFIGS:
            pmod._launch_config = lambda *a, _c=cfg: _c
            try:
                got = pmod.prefill_attention(*args, scale).float()
                if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
                    res.append({"config": cfg, "error": "mismatch"})
                    continue
                res.append({"config": cfg, "us": timing.graph_time(call, [None]) * 1e6})
            except Exception as e:  # noqa: BLE001
                res.append({"config": cfg, "error": type(e).__name__})
            finally:
                pmod._launch_config = default
        best = min((r for r in res if "us" in r), key=lambda r: r["us"], default=None)
        f = flops(news, ctxs, d)
        row = {"head_dim": d, "shape": name, "default": list(default(d, torch.bfloat16, True)),
               "default_us": base * 1e6, "default_fraction": f / base / ceil["bf16_flops_per_s"], "best": best,
               "all": res}
        if best:
            row["best_fraction"] = f / (best["us"] * 1e-6) / ceil["bf16_flops_per_s"]
        rows.append(row)
        print(f"D={d} {name}: default {row['default']} {row['default_us']:.0f} us "
              f"({100 * row['default_fraction']:.0f}%), best {best and best['config']} "
              f"{best and round(best['us'])} us ({100 * row.get('best_fraction', 0):.0f}%)", flush=True)
        out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "ceilings": ceil, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
