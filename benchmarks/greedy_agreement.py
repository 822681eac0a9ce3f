"""Greedy agreement of llmplug with stock HF on the trained small model, with stock HF against itself as the floor.

Prompts are windows of the held-out split of the stdlib corpus (``--corpus``, see ``eval_quant_ppl.py``). Stock HF
(sdpa) generates ``--new-tokens`` greedily; the noise floor is stock HF with eager attention; llmplug runs on the same
model after ``optimize``. Reported: the fraction of prompts whose continuations are identical, and the first
position where each differs. Issue 2 asks for >= 90% identical over 32 tokens in bf16 on the GPU.

    python benchmarks/greedy_agreement.py --corpus .corpus --out agreement.json [--no-fuse] [--batch 1]

``--batch N`` generates N prompts at a time (default: all at once; 1 takes the batch-1 decode path: GEMVs, norms in
their prologue, CUDA graphs). ``--no-fuse`` optimizes with ``fuse=False`` (HF's own modules around llmplug's
attention): what the fused projections, norms, RoPE and MLP add to the differences.
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from eval_quant_ppl import load_trained, trained_model_args  # noqa: E402

import llmplug  # noqa: E402
from llmplug.bench import report  # noqa: E402
from llmplug.bench.e2e import row_agreement  # noqa: E402


@torch.inference_mode()
def main() -> None:
    ap = trained_model_args(argparse.ArgumentParser())
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out")
    ap.add_argument("--no-fuse", action="store_true")
    ap.add_argument("--batch", type=int, default=0)
    args = ap.parse_args()
    model, ids = load_trained(args)
    stride = (ids.numel() - args.prompt_len) // args.prompts
    rows = torch.stack([ids[i * stride: i * stride + args.prompt_len] for i in range(args.prompts)]).to(args.device)
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    batch = args.batch or len(rows)

    def generate():
        chunks = [rows[i:i + batch] for i in range(0, len(rows), batch)]
        out = torch.cat([model.generate(c, attention_mask=torch.ones_like(c), **gen) for c in chunks])
        return out[:, args.prompt_len:]

    stock = generate()
    model.set_attn_implementation("eager")
    eager = generate()
    model.set_attn_implementation("sdpa")
    llmplug.optimize(model, fuse=not args.no_fuse)
    fast = generate()
    res = {"model": args.model, "dtype": args.dtype, "device": args.device, "prompts": args.prompts,
           "fuse": not args.no_fuse, "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "llmplug_vs_stock": row_agreement(fast, stock), "stock_eager_vs_stock_sdpa": row_agreement(eager, stock)}
    for key in ("llmplug_vs_stock", "stock_eager_vs_stock_sdpa"):
        print(f"{key}: {100 * res[key]['rows_identical']:.1f}% of {args.prompts} continuations identical over "
              f"{args.new_tokens} tokens; first differences at {sorted(res[key]['first_divergence'])}")
    if args.out:
        report.save({**report.environment(), **res}, args.out)


if __name__ == "__main__":
    main()
