"""The decode step's attention block at one split, two ways, timed alike (GPU only): RoPE + store
(``rope_store_kv``) then ``decode_attention``, against the fused ``rope_decode_attention``; each after the q/k/v GEMM
that feeds it, over ``--layers`` caches (pages scattered over a pool), in one CUDA graph under programmatic launch.

    python benchmarks/rope_attention_ab.py --rows 128 --contexts 256 1024 2048 --out ab.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from llmplug.bench.timing import graph_time
from llmplug.ops._triton import programmatic_launch
from llmplug.ops.decode_attention import decode_attention
from llmplug.ops.rope_decode_attention import rope_decode_attention
from llmplug.ops.rope_store_kv import rope_store_kv

PAGE = 16


def layer_caches(rows: int, context: int, kv_heads: int, dim: int, layers: int, dt):
    """Per layer ``(k_cache, v_cache, block_tables)``: each row's pages a random draw from the layer's pool."""
    pages = rows * (-(-context // PAGE))
    out = []
    for _ in range(layers):
        kc = torch.randn(pages, PAGE, kv_heads, dim, device="cuda", dtype=dt)
        vc = torch.randn_like(kc)
        bt = torch.randperm(pages, device="cuda", dtype=torch.int32).view(rows, -1)
        out.append((kc, vc, bt))
    return out


def time_context(context: int, args, x, w, cos, sin) -> dict:
    """The three variants' us a layer at one context."""
    b, h, hkv, d = args.rows, args.heads, args.kv_heads, args.dim
    dt = x.dtype
    caches = layer_caches(b, context, hkv, d, args.layers, dt)
    seq_lens = torch.full((b,), context, device="cuda", dtype=torch.int32)
    scale = d ** -0.5

    def qkv_views():
        qkv = F.linear(x, w)
        return qkv[:, :h * d].view(b, h, d), qkv[:, h * d:(h + hkv) * d].view(b, hkv, d), \
            qkv[:, (h + hkv) * d:].view(b, hkv, d)

    def slots(bt):
        pos = context - 1
        return (bt[:, pos // PAGE].long() * PAGE + pos % PAGE)

    caches = [(kc, vc, bt, slots(bt)) for kc, vc, bt in caches]

    def plain(c):
        kc, vc, bt, sm = c
        q, k, v = qkv_views()
        rope_store_kv(q, k, v, cos, sin, kc, vc, sm)
        return decode_attention(q, kc, vc, bt, seq_lens, scale, _num_splits=1)

    def fused(c):
        kc, vc, bt, sm = c
        q, k, v = qkv_views()
        return rope_decode_attention(q, k, v, cos, sin, kc, vc, sm, bt, seq_lens, scale,
                                     _num_splits=1)

    def gemm(c):
        del c
        return qkv_views()

    with programmatic_launch():
        a, f = plain(caches[0]), fused(caches[0])
        err = (a.float() - f.float()).abs().max().item()
        t = {name: graph_time(fn, caches) * 1e6 for name, fn in
             (("gemm", gemm), ("plain", plain), ("fused", fused), ("plain2", plain), ("fused2", fused))}
    kv_bytes = 2 * b * context * hkv * d * 2
    row = {"context": context, "rows": b, "us": t, "max_diff": err, "kv_bytes": kv_bytes}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    b, h, hkv, d = args.rows, args.heads, args.kv_heads, args.dim
    x = torch.randn(b, args.hidden, device="cuda", dtype=dt)
    w = torch.randn((h + 2 * hkv) * d, args.hidden, device="cuda", dtype=dt) / args.hidden ** 0.5
    cos = torch.rand(b, d, device="cuda", dtype=dt)
    sin = torch.rand(b, d, device="cuda", dtype=dt)
    rows = []
    for context in args.contexts:
        row = time_context(context, args, x, w, cos, sin)
        rows.append(row)
        print(row, flush=True)
    print("\n| context | q/k/v GEMM us | + RoPE/store + attention | + fused | fused again | plain again |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        t = r["us"]
        print(f"| {r['context']} | {t['gemm']:.1f} | {t['plain']:.1f} | {t['fused']:.1f} | {t['fused2']:.1f} "
              f"| {t['plain2']:.1f} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
