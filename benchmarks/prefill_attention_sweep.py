"""Prefill attention's launch config (BLOCK_M, BLOCK_N, warps, stages, query heads a program packs) at the Engine's
packed-step shapes: GPU time in a CUDA graph against the default (``_launch_config``, ``_pack``), as a share of the
measured bf16 matmul ceiling. Configs whose output differs from the default's beyond bf16 noise, or that fail to
launch, are listed as such. A short table (us a call, the default first) is printed last.

Usage: python benchmarks/prefill_attention_sweep.py OUT.json [--dims 64 128]   (CUDA; JSON written after every shape)
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
_A_LENS = torch.randint(32, 1025, (16,), generator=torch.Generator().manual_seed(0)).tolist()  # (a)'s prompts
SHAPES = [  # (name, new tokens per sequence, context per sequence); zero-length ones are a captured step's padding
    ("(a)-like: 16 prompts 32-1024", _A_LENS, [0] * 16),
    ("(a)-like, padded to 256 sequences", _A_LENS + [0] * 240, [0] * 256),
    ("32 x 128 prompts", [128] * 32, [0] * 32),
    ("8 x 512 prompts", [512] * 8, [0] * 8),
    ("one 4096 chunk", [4096], [0]),
    ("2048 after 2048", [2048], [2048]),
    ("2048 after 6000 + 4 x 512", [2048] + [512] * 4, [6000] + [0] * 4),
]
CONFIGS = [  # (BLOCK_M, BLOCK_N, warps, stages, pack)
    *[(128, 64, 4, 3, p) for p in (1, 2, 4)],
    *[(128, n, w, st, 4) for n in (32, 128) for w in (4, 8) for st in (2, 3)],
    (128, 64, 8, 3, 4), (128, 64, 4, 2, 4), (128, 64, 8, 2, 4),
    *[(64, n, 4, st, p) for n in (32, 64) for st in (2, 3) for p in (2, 4)],
    (256, 64, 8, 3, 4), (256, 64, 8, 2, 4), (256, 32, 8, 3, 4),
]
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
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--configs", nargs="+", help="BLOCK_M,BLOCK_N,warps,stages,pack each (default: the sweep's list)")
    a = ap.parse_args()
    configs = [tuple(int(x) for x in c.split(",")) for c in a.configs] if a.configs else CONFIGS
    out, ceil, rows = Path(a.out), timing.ceilings("cuda"), []
    default_cfg, default_pack = pmod._launch_config, pmod._pack
    for d, (name, news, ctxs) in itertools.product(a.dims, SHAPES):
        args = inputs(news, ctxs, d)
        o = torch.empty_like(args[0])
        scale = d ** -0.5

        def call(_, args=args, scale=scale, o=o):
            return pmod.prefill_attention(*args, scale, out=o)

        live = slice(0, sum(news))
        want = pmod.prefill_attention(*args, scale).float()[live]
        base = timing.graph_time(call, [None])
        res = []
        for cfg in configs:
            pmod._launch_config = lambda *_, _c=cfg: _c[:4]
            pmod._pack = lambda *_, _c=cfg: _c[4]
            try:
                got = pmod.prefill_attention(*args, scale).float()[live]
                if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
                    res.append({"config": cfg, "error": "mismatch"})
                    continue
                res.append({"config": cfg, "us": timing.graph_time(call, [None]) * 1e6})
            except Exception as e:  # noqa: BLE001
                res.append({"config": cfg, "error": type(e).__name__})
            finally:
                pmod._launch_config, pmod._pack = default_cfg, default_pack
        best = min((r for r in res if "us" in r), key=lambda r: r["us"], default=None)
        f = flops(news, ctxs, d)
        dflt = [*default_cfg(d, torch.bfloat16, True), default_pack(HEADS // KV_HEADS, default_cfg(d, torch.bfloat16,
                                                                                                  True)[0], True)]
        row = {"head_dim": d, "shape": name, "default": dflt, "default_us": base * 1e6,
               "default_fraction": f / base / ceil["bf16_flops_per_s"], "best": best, "all": res}
        if best:
            row["best_fraction"] = f / (best["us"] * 1e-6) / ceil["bf16_flops_per_s"]
        rows.append(row)
        print(f"D={d} {name}: default {row['default']} {row['default_us']:.0f} us "
              f"({100 * row['default_fraction']:.0f}%), best {best and best['config']} "
              f"{best and round(best['us'])} us ({100 * row.get('best_fraction', 0):.0f}%)", flush=True)
        out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "ceilings": ceil, "rows": rows}, indent=1))
    print("\n| D | shape | default | " + " | ".join(str(c) for c in configs[:3]) + " | best |")
    for r in rows:
        by = {tuple(x["config"]): x.get("us") for x in r["all"]}
        cells = [f"{by[c]:.1f}" if by.get(c) else "-" for c in configs[:3]]
        print(f"| {r['head_dim']} | {r['shape']} | {r['default_us']:.1f} | " + " | ".join(cells)
              + f" | {r['best'] and r['best']['config']} {r['best'] and round(r['best']['us'], 1)} |")


if __name__ == "__main__":
    main()
