"""cuBLASLt's other algorithms on a serving step's GEMMs: GPU time of every candidate against ``F.linear``.

Usage: python benchmarks/lt_algo_probe.py OUT.json [--model llama-1b] [--rows 64 128 256] [--matrices qkv o ...]
           [--heuristics 32] [--split-heuristics 8]

For each (rows, matrix): the heuristic's candidates (the first is what torch runs) and, for the first
``--split-heuristics`` of them, every split-K count and reduction scheme cuBLASLt accepts
(:mod:`llmplug.ops._cublaslt`). Each candidate's output is checked against ``F.linear`` (bf16 tolerance) and, for the
fastest, against itself on a second run (bit for bit); each is timed in a CUDA graph over rotating weight copies (more
than L2 together). The last table: ``F.linear``, the heuristic's first, the fastest, with shares of the read roofline.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.bench import report, timing  # noqa: E402
from llmplug.ops._cublaslt import LtMatmul  # noqa: E402

SHAPES = {  # (N, K)
    "llama-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                 "lm_head": (128256, 2048)},
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                 "lm_head": (128256, 4096)},
}


def probe(m: int, n: int, k: int, heuristics: int, split_heuristics: int, read: float) -> dict:
    bf = torch.bfloat16
    copies = max(2, min(16, (256 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, dtype=bf, device="cuda") * k ** -0.5 for _ in range(copies)]
    x = torch.randn(m, k, dtype=bf, device="cuda")
    out = torch.empty(m, n, dtype=bf, device="cuda")
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    nbytes = n * k * 2 + m * k * 2 + m * n * 2
    want = F.linear(x, ws[0])
    base = timing.graph_time(lambda w: F.linear(x, w), ws)
    lt = LtMatmul(m, n, k, bf)
    cands = lt.heuristics(heuristics)
    seen, algos = set(), []
    for i, a in enumerate(cands):
        for v in [a] + (lt.variants(a) if i < split_heuristics else []):
            if v.data not in seen:
                seen.add(v.data)
                algos.append((i, v))
    rows = []
    for i, a in algos:
        try:
            got = lt(x, ws[0], out, a, workspace).clone()
            if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                rows.append({"heuristic": i, "config": dict(a.config), "error": "mismatch"})
                continue
            t = timing.graph_time(lambda w, a=a: lt(x, w, out, a, workspace), ws)
            rows.append({"heuristic": i, "config": dict(a.config), "workspace": a.workspace, "us": t * 1e6,
                         "algo": a})
        except RuntimeError as e:
            rows.append({"heuristic": i, "config": dict(a.config), "error": str(e)})
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    best = timed[0] if timed else None
    first = next((r for r in rows if r["heuristic"] == 0 and "us" in r and r["config"] == dict(cands[0].config)),
                 None)
    same = None
    if best:
        a = best["algo"]
        one = lt(x, ws[1], out, a, workspace).clone()
        same = torch.equal(one, lt(x, ws[1], out, a, workspace))
    for r in rows:
        r.pop("algo", None)
    return {"m": m, "n": n, "k": k, "linear_us": base * 1e6, "linear_share": nbytes / base / read,
            "first_us": first["us"] if first else None, "best": best, "best_share": nbytes / best["us"] * 1e6 / read
            if best else None, "best_deterministic": same, "candidates": len(cands), "timed": len(timed),
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--matrices", nargs="+", default=None)
    ap.add_argument("--heuristics", type=int, default=32)
    ap.add_argument("--split-heuristics", type=int, default=8)
    args = ap.parse_args()
    res = {"env": report.environment(), "model": args.model, "ceilings": timing.ceilings("cuda"), "runs": []}
    read = res["ceilings"]["read_bytes_per_s"]
    shapes = SHAPES[args.model]
    for m in args.rows:
        for name in args.matrices or list(shapes):
            n, k = shapes[name]
            r = probe(m, n, k, args.heuristics, args.split_heuristics, read)
            r["matrix"] = name
            res["runs"].append(r)
            b = r["best"] or {}
            print(f"M {m:4d} {name:8s} linear {r['linear_us']:7.1f} us ({r['linear_share']:.0%})  first "
                  f"{r['first_us'] or float('nan'):7.1f}  best {b.get('us', float('nan')):7.1f} "
                  f"({(r['best_share'] or 0):.0%}) {b.get('config')} ws {b.get('workspace')} "
                  f"det={r['best_deterministic']}  [{r['timed']} timed of {r['candidates']} candidates]", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
