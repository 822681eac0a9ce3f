"""Speculative ``generate`` against the same call without speculation, in one process (issue 23's acceptance).

Acceptance on random weights means nothing, so the ``oracle`` section's proposer replays the target's own greedy
continuation (from the plain run) with each draft token corrupted at rate ``1 - alpha``; outputs must still equal
the plain run's, so the random weights are made decisive (:func:`decisive`). ``draft`` pays a draft model's real
cost (a model of ``--draft-shape``, its own paged KV and steps)
but proposes the oracle's tokens at ``alpha = 0.8``. ``trained`` measures real acceptance of prompt lookup and of the
trained draft model on the shipped models, on prompts from ``--prompts`` (``--make-prompts`` builds them from held-out
standard-library files: a near-copy of each file's continuation, then the file's start).

    python benchmarks/spec_bench.py --sections oracle draft trained --out results.json
"""

import argparse
import functools
import json
import random
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug.bench import timing  # noqa: E402
from llmplug.bench.shapes import build, weight_bytes  # noqa: E402
from llmplug.engine.sequences import SequenceBatch  # noqa: E402
from llmplug.spec.proposers import DraftModelProposer  # noqa: E402
from llmplug.state import ensure_state  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class OracleProposer:
    """Drafts from a known continuation (``rows[r]``: prompt + the target's greedy tokens), each replaced by another
    id with probability ``1 - alpha``. Optionally runs ``pay_for`` (a real proposer) first, for its cost only."""

    def __init__(self, rows: list[list[int]], alpha: float, vocab: int, seed: int = 0, pay_for=None) -> None:
        self.rows, self.alpha, self.vocab, self.pay_for = rows, alpha, vocab, pay_for
        self.rng = random.Random(seed)

    def propose(self, rows: list[int], histories: list[list[int]], k: int) -> list[list[int]]:
        if self.pay_for is not None:
            self.pay_for.propose(rows, histories, k)
        out = []
        for r in rows:
            true = self.rows[r][len(histories[r]):len(histories[r]) + k]
            out.append([t if self.rng.random() < self.alpha else (t + 1 + self.rng.randrange(self.vocab - 1))
                        % self.vocab for t in true])
        return out

    def release(self) -> None:
        if self.pay_for is not None:
            self.pay_for.release()


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up, and the warm-up's result."""
    result = fn()
    times = []
    for _ in range(repeats):
        timing.sync("cuda")
        t0 = time.perf_counter()
        fn()
        timing.sync("cuda")
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def decisive(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights whose greedy choice is far from ties, so that bf16 rounding differences between a decode step
    and a verify step never flip it (HF's initialisation gives near-uniform logits, and plain greedy itself then
    changes with the batch's kernels): the layers scaled down 100x, the LM head a copy of the embedding, so each
    step's argmax is its input token by a wide margin. Costs are those of the shape (no kernel reads values)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name and "lm_head" not in name:
                p.mul_(0.01)
        model.get_output_embeddings().weight.copy_(model.get_input_embeddings().weight)
    return model


def oracle(args, ceil) -> list[dict]:
    torch.manual_seed(0)
    model = llmplug.optimize(decisive(build(args.model, torch.bfloat16, "cuda")))
    roofline = ceil["read_bytes_per_s"] / weight_bytes(model)
    vocab = model.config.vocab_size
    draft = None
    if "draft" in args.sections:
        torch.manual_seed(1)
        draft = llmplug.optimize(build(args.draft_shape, torch.bfloat16, "cuda"))
    rows = []
    for b in args.batches:
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(3, vocab, (b, 128), generator=g).cuda()
        gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False)
        base_s, ref = timed(functools.partial(model.generate, **gen), args.repeats)
        ref_rows = ref.tolist()
        base = {"model": args.model, "batch": b, "proposer": "none", "tok_s": b * args.new_tokens / base_s,
                "step_fraction_of_roofline": (args.new_tokens / base_s / roofline) if b == 1 else None}
        rows.append(base)
        print(f"{args.model} b{b} plain: {base['tok_s']:,.0f} tok/s", flush=True)
        cases = [("oracle", a, None) for a in args.alphas]
        if draft is not None and b in args.draft_batches:
            cases.append(("draft " + args.draft_shape, 0.8, draft))
        for name, alpha, dmodel in cases:
            call = functools.partial(_oracle_call, model, gen, ref_rows, alpha, vocab, b, dmodel, args)
            secs, out = timed(call, args.repeats)
            stats = llmplug.spec_stats(model)
            row = {"model": args.model, "batch": b, "proposer": name, "alpha": alpha, "k": args.k,
                   "tok_s": b * args.new_tokens / secs, "speedup": base_s / secs, "identical": torch.equal(out, ref),
                   "acceptance": stats.acceptance_rate, "tokens_per_step": stats.tokens_per_step,
                   "steps": stats.steps}
            rows.append(row)
            print(f"  {name} alpha={alpha}: {row['speedup']:.2f}x, {row['tokens_per_step']:.2f} tok/step, "
                  f"acceptance {row['acceptance']:.2f}, identical {row['identical']}", flush=True)
    for m in (model, draft):
        if m is not None:
            llmplug.unoptimize(m)
    return rows


def _oracle_call(model, gen: dict, ref_rows, alpha: float, vocab: int, seed: int, draft, args):
    """One speculative generate with the oracle's drafts (and a draft model's cost when ``draft`` is given)."""
    pay = None
    if draft is not None:
        ids = gen["input_ids"]
        pay = DraftModelProposer(SequenceBatch(ensure_state(draft).runner, ids, None,
                                               ids.shape[1] + args.new_tokens + args.k, prefix_cache=False))
    proposer = OracleProposer(ref_rows, alpha, vocab, seed=seed, pay_for=pay)
    return model.generate(**gen, assistant_model=proposer, num_assistant_tokens=args.k)


def make_prompts(path: Path, n: int, tokenizer_dir: Path, copy_len: int = 192, head_len: int = 192) -> None:
    """Input-grounded prompts from held-out stdlib files (``crc32(path) % 50 == 0``, as the models' training split):
    a near-copy (every 20th token changed) of the file's tokens ``[head, head + copy)``, a blank line, then the file's
    first ``head`` tokens to continue."""
    import sysconfig

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts
                   and zlib.crc32(str(p.relative_to(lib)).encode()) % 50 == 0)
    rng = random.Random(0)
    prompts = []
    for f in files:
        ids = tok(f.read_text(errors="ignore"))["input_ids"]
        if len(ids) < head_len + copy_len:
            continue
        copy = [t if i % 20 else rng.randrange(len(tok)) for i, t in enumerate(ids[head_len:head_len + copy_len])]
        prompts.append(copy + tok("\n\n")["input_ids"] + ids[:head_len])
        if len(prompts) == n:
            break
    path.write_text(json.dumps({"source": "held-out stdlib files", "prompts": prompts}))


def trained(args) -> list[dict]:
    from llmplug.loading import load_causal_lm

    target = llmplug.optimize(load_causal_lm(str(ROOT / "models/llmplug-stdlib-small"), "cuda", dtype=torch.bfloat16))
    draft = llmplug.optimize(load_causal_lm(str(ROOT / "models/llmplug-stdlib-draft"), "cuda", dtype=torch.bfloat16))
    prompts = json.loads(args.prompts.read_text())["prompts"]
    rows = []
    for b in (1, 8):
        width = max(map(len, prompts[:b]))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts[:b]], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts[:b]], device="cuda")
        gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                   eos_token_id=None, pad_token_id=0)
        base_s, ref = timed(functools.partial(target.generate, **gen), args.repeats)
        rows.append({"model": "llmplug-stdlib-small", "batch": b, "proposer": "none",
                     "tok_s": b * args.new_tokens / base_s})
        for name, extra in (("prompt lookup", dict(prompt_lookup_num_tokens=args.k)),
                            ("llmplug-stdlib-draft", dict(assistant_model=draft, num_assistant_tokens=args.k))):
            secs, out = timed(functools.partial(target.generate, **gen, **extra), args.repeats)
            stats = llmplug.spec_stats(target)
            rows.append({"model": "llmplug-stdlib-small", "batch": b, "proposer": name, "k": args.k,
                         "tok_s": b * args.new_tokens / secs, "speedup": base_s / secs,
                         "identical": torch.equal(out, ref), "acceptance": stats.acceptance_rate,
                         "tokens_per_step": stats.tokens_per_step})
            print(f"trained b{b} {name}: {base_s / secs:.2f}x, {stats.tokens_per_step:.2f} tok/step, acceptance "
                  f"{stats.acceptance_rate:.2f}, identical {rows[-1]['identical']}", flush=True)
    return rows


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
        make_prompts(args.prompts, args.make_prompts, ROOT / "models/llmplug-stdlib-small")
        return 0
    ceil = timing.ceilings("cuda")
    rows = []
    if "oracle" in args.sections or "draft" in args.sections:
        rows += oracle(args, ceil)
    if "trained" in args.sections:
        rows += trained(args)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "ceilings": ceil, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
