"""Decode attention over contexts of different lengths: rows in arrival (random) order against longest first.

Usage: python benchmarks/decode_attention_order.py OUT.json

The kernel starts its programs in row order (:mod:`llmplug.ops.decode_attention`), so with rows longest first the short
contexts fill the tail. Each case draws its lengths uniformly, spreads every row's pages randomly over the pool
(:func:`~benchmarks.decode_attention_sweep.scattered_pools`) and times the default configuration and 32- / 64-token
tiles in a CUDA graph over rotating pools larger than L2. Every output is checked against the random-order default's.
Shapes: 32 query heads over 8 KV heads, pages of 16 tokens. The bytes counted are the K/V pages the contexts cover.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_attention_sweep import HEADS, KV_HEADS, scattered_pools  # noqa: E402
from llmplug.bench import timing  # noqa: E402
from llmplug.ops import decode_attention as dmod  # noqa: E402

CASES = [  # (name, batch, shortest, longest context, head dim)
    ("1B (a) midway: 256 rows, 160-1152", 256, 160, 1152, 64),
    ("1B (a) span: 256 rows, 32-1280", 256, 32, 1280, 64),
    ("1B (b): 128 rows, all 1056", 128, 1056, 1056, 64),
    ("1B (b) late: 128 rows, all 1800", 128, 1800, 1800, 64),
    ("8B: 64 rows, 128-2048", 64, 128, 2048, 128),
    ("8 rows, all 1024 (split)", 8, 1024, 1024, 64),
    ("1 row, 1024 (split)", 1, 1024, 1024, 128),
]


def case(batch: int, lo: int, hi: int, d: int, read: float, seed: int) -> dict:
    lens = torch.randint(lo, hi + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    kv_bytes = int(lens.sum()) * KV_HEADS * d * 2 * 2
    pool = scattered_pools(lens.tolist(), d, max(2, -(-(200 << 20) // kv_bytes)), "cuda")
    q = torch.randn(batch, HEADS, d, dtype=torch.bfloat16, device="cuda")
    seq = lens.to(torch.int32).cuda()
    order = torch.argsort(lens, descending=True).cuda()
    want = dmod.decode_attention(q, *pool[0], seq, d ** -0.5).float()
    default, res = dmod.tile_config, {}
    for longest_first in (False, True):
        qq, ss = (q[order], seq[order]) if longest_first else (q, seq)
        pp = [(k, v, t[order]) for k, v, t in pool] if longest_first else pool
        for tile in (None, 32, 64):
            key = f"{'longest first' if longest_first else 'random'}, tile {tile or 'default'}"
            if tile is not None:
                dmod.tile_config = lambda *a, _c=(tile, 4, 3): _c
            try:
                got = dmod.decode_attention(qq, *pp[0], ss, d ** -0.5).float()
                got = got[torch.argsort(order)] if longest_first else got
                if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
                    res[key] = {"error": "mismatch"}
                    continue
                sec = timing.graph_time(lambda p, qq=qq, ss=ss: dmod.decode_attention(qq, *p, ss, d ** -0.5), pp)
                res[key] = {"us": sec * 1e6, "of_read_rate": kv_bytes / sec / read}
            finally:
                dmod.tile_config = default
    return {"kv_bytes": kv_bytes, "results": res}


def main() -> None:
    out, rows = Path(sys.argv[1]), []
    read = timing.ceilings("cuda")["read_bytes_per_s"]
    for seed, (name, batch, lo, hi, d) in enumerate(CASES):
        row = {"case": name, **case(batch, lo, hi, d, read, seed)}
        rows.append(row)
        cells = ", ".join(f"{k} {v['us']:.1f} us ({100 * v['of_read_rate']:.0f}%)" if "us" in v else f"{k} {v}"
                          for k, v in row["results"].items())
        print(f"{name}: {cells}", flush=True)
        torch.cuda.empty_cache()
        out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
