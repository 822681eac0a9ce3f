"""Decode attention at serving batch sizes: GPU time of each tile configuration and split count against the default.

Usage: python benchmarks/decode_attention_sweep.py OUT.json [--head-dims 64 128] [--batches 64 128 256]
           [--contexts 512 1024 2048] [--block-ns 32 64 128 256] [--warps 4 8] [--stages 2 3] [--splits 0 1 2]

Each call is captured in a CUDA graph over rotating copies of the pool (larger than L2 together) and replayed. The
bytes counted are the K/V pages the batch's contexts cover. Every configuration's output is checked against the
default's (bf16 tolerance) before it is timed. Shapes: 32 query heads over 8 KV heads (the 1B shape at D=64, the 8B
shape at D=128), pages of 16 tokens, every row at the full context.
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.bench import timing  # noqa: E402
from llmplug.ops import decode_attention as dmod  # noqa: E402

PAGE, HEADS, KV_HEADS = 16, 32, 8
BLOCK_NS, WARPS, STAGES, SPLITS = (32, 64, 128, 256), (4, 8), (2, 3), (0, 1, 2)  # splits 0: the default choice


def scattered_pools(lens: list[int], head_dim: int, copies: int, device: str) -> list[tuple]:
    """``copies`` (k_cache, v_cache, block_tables) sets for rows of contexts ``lens``: each row's pages its own,
    scattered over the pool (as a long-running Engine's are)."""
    width, pages = -(-max(lens) // PAGE), sum(-(-n // PAGE) for n in lens)
    out = []
    for _ in range(copies):
        k = torch.randn(pages, PAGE, KV_HEADS, head_dim, dtype=torch.bfloat16, device=device)
        perm, table, i = torch.randperm(pages, dtype=torch.int32), torch.zeros(len(lens), width, dtype=torch.int32), 0
        for row, n in enumerate(lens):
            m = -(-n // PAGE)
            table[row, :m] = perm[i:i + m]
            i += m
        out.append((k, torch.randn_like(k), table.to(device)))
    return out


def pools(batch: int, context: int, head_dim: int, copies: int, device: str):
    """:func:`scattered_pools` of ``batch`` rows at ``context`` tokens, and ``q``, ``seq_lens``."""
    q = torch.randn(batch, HEADS, head_dim, dtype=torch.bfloat16, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return scattered_pools([context] * batch, head_dim, copies, device), q, seq_lens


def run(q, seq_lens, pool, splits: int) -> torch.Tensor:
    k, v, tables = pool
    return dmod.decode_attention(q, k, v, tables, seq_lens, q.shape[-1] ** -0.5, _num_splits=splits)


def sweep(d: int, b: int, c: int, ceil: dict, grid=(BLOCK_NS, WARPS, STAGES, SPLITS), device: str = "cuda") -> dict:
    """Every configuration of ``grid`` (tile sizes, warps, stages, splits) at one (head dim, batch, context)
    against the default, GPU time per call."""
    default = dmod.tile_config
    kv_bytes = 2 * b * c * KV_HEADS * d * 2
    copies = max(2, -(-(200 << 20) // kv_bytes))  # > 100 MB of pages together: no L2 reuse
    pool, q, seq_lens = pools(b, c, d, copies, device)
    want = run(q, seq_lens, pool[0], 0)
    base = timing.graph_time(lambda p: run(q, seq_lens, p, 0), pool)
    results = []
    for block_n, warps, stages, splits in itertools.product(*grid):
        config = [block_n, warps, stages, splits]
        dmod.tile_config = lambda *a, _c=(block_n, warps, stages): _c
        try:
            if not torch.allclose(run(q, seq_lens, pool[0], splits).float(), want.float(), rtol=2e-2, atol=2e-2):
                results.append({"config": config, "error": "mismatch"})
                continue
            sec = timing.graph_time(lambda p, s=splits: run(q, seq_lens, p, s), pool)
            results.append({"config": config, "us": sec * 1e6})
        except Exception as e:  # noqa: BLE001 - a configuration the compiler rejects (shared memory, registers)
            results.append({"config": config, "error": type(e).__name__})
        finally:
            dmod.tile_config = default
    timed = [r for r in results if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    row = {"head_dim": d, "batch": b, "context": c, "kv_bytes": kv_bytes, "default_us": base * 1e6,
           "default_config": list(default(max(16, d), 2, 2, b * KV_HEADS, dmod.gpu_name(q.device)))
           + [dmod.launch_splits(q, pool[0][0], pool[0][2], -1)],
           "default_fraction": kv_bytes / base / ceil["read_bytes_per_s"], "best": best, "all": results}
    if best:
        row["best_fraction"] = kv_bytes / (best["us"] * 1e-6) / ceil["read_bytes_per_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--block-ns", type=int, nargs="+", default=list(BLOCK_NS))
    ap.add_argument("--warps", type=int, nargs="+", default=list(WARPS))
    ap.add_argument("--stages", type=int, nargs="+", default=list(STAGES))
    ap.add_argument("--splits", type=int, nargs="+", default=list(SPLITS), help="0: the default's choice")
    args = ap.parse_args()
    grid = (args.block_ns, args.warps, args.stages, args.splits)
    ceil = timing.ceilings("cuda")
    rows = []
    for d, b, c in itertools.product(args.head_dims, args.batches, args.contexts):
        row = sweep(d, b, c, ceil, grid)
        rows.append(row)
        best = row["best"]
        print(f"D={d} batch {b} ctx {c}: default {row['default_config']} {row['default_us']:.1f} us "
              f"({100 * row['default_fraction']:.0f}%), best {best and best['config']} "
              f"{best and round(best['us'], 1)} us ({100 * row.get('best_fraction', 0):.0f}%)", flush=True)
        torch.cuda.empty_cache()
        # after every shape, so a run cut short by a time limit keeps what it measured
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "ceilings": ceil, "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
