"""Speculative ``generate`` against the same call without speculation, in one process (issue 23's acceptance): the
oracle curve on a random-weight shape, a draft model shape's cost, and real acceptance on the trained models
(:mod:`llmplug.bench.spec` says how each is made). ``llmplug bench speculative`` runs the same code.

    python benchmarks/spec_bench.py --sections oracle draft trained --out results.json
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.bench import spec, timing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=["oracle", "draft", "trained"],
                    choices=["oracle", "draft", "trained"])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--draft-shape", default="llama-1b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--draft-batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.0, 0.5, 0.8, 0.95])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=Path, default=ROOT / "benchmarks/results/spec_prompts_stdlib.json")
    ap.add_argument("--make-prompts", type=int, default=0, help="build N prompts into --prompts and exit")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.make_prompts:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ROOT / "models/llmplug-stdlib-small")
        args.prompts.write_text(json.dumps({"source": "held-out stdlib files",
                                            "prompts": spec.grounded_prompts(tok, args.make_prompts)}))
        return 0
    ceil = timing.ceilings("cuda")
    rows = []
    if "oracle" in args.sections or "draft" in args.sections:
        rows += spec.oracle(args.model, ceil, args.batches, args.alphas if "oracle" in args.sections else (), args.k,
                            args.new_tokens, args.repeats, args.draft_shape if "draft" in args.sections else None,
                            args.draft_batches)
    if "trained" in args.sections:
        prompts = json.loads(args.prompts.read_text())["prompts"]
        rows += spec.trained("cuda", torch.bfloat16, prompts, (1, 8), args.new_tokens, args.k, args.repeats)
    print("\n".join(spec.table(rows)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "command": " ".join(sys.argv), "ceilings": ceil, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
