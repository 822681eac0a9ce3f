"""``generate`` with an evaluation harness's stopping criterion against the same call without it, one process.

lm-eval-harness stops each ``generate_until`` request with its own criteria, which decode each row's tail and look
for a stop sequence. This times the same greedy ``generate`` with and without such a criterion (alternated, same
prompts; the stop sequence never occurs, so both produce every token and must produce the same ones), on random
bf16 weights, and states the criterion-free run's share of the batch-1 weight-read roofline.

    python benchmarks/stop_criteria.py --models llama-1b llama-8b --batches 1 8 --out results.json --commit abc
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, StoppingCriteria, StoppingCriteriaList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug.bench import report, timing  # noqa: E402
from llmplug.bench.shapes import build, weight_bytes  # noqa: E402

TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "llmplug-stdlib-small"


class DecodedTailStop(StoppingCriteria):
    """Harness-style: each row is done once the decoded text of its last few new tokens holds ``stop``; rows stay
    done, and generation stops when every row is (ids are taken modulo the tokenizer's vocabulary, since the model's
    is larger)."""

    def __init__(self, tokenizer, stop: str, prompt_len: int, batch: int) -> None:
        self.tokenizer, self.stop, self.prompt_len = tokenizer, stop, prompt_len
        self.lookback = len(tokenizer.encode(stop, add_special_tokens=False)) + 2
        self.done = [False] * batch

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        tail = input_ids[:, self.prompt_len:][:, -self.lookback:] % len(self.tokenizer)
        for i, text in enumerate(self.tokenizer.batch_decode(tail)):
            self.done[i] = self.done[i] or self.stop in text
        return all(self.done)


def time_pair(model, gen: dict, make_stop, repeats: int) -> tuple[dict, bool]:
    """Seconds of ``generate(**gen)`` without and with ``make_stop()`` as its criterion, alternated, and whether both
    gave the same tokens."""
    calls = {"plain": lambda: model.generate(**gen),
             "harness": lambda: model.generate(**gen, stopping_criteria=StoppingCriteriaList([make_stop()]))}
    same = torch.equal(calls["plain"](), calls["harness"]())  # also the warm-up of both
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            timing.sync("cuda")
            t0 = time.perf_counter()
            fn()
            timing.sync("cuda")
            times[name].append(time.perf_counter() - t0)
    return times, same


def run(model_name: str, batches: list[int], args, tok, ceil: dict) -> list[dict]:
    model = llmplug.optimize(build(model_name, torch.bfloat16, "cuda"))
    roofline = ceil["read_bytes_per_s"] / weight_bytes(model)
    rows = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(3, model.config.vocab_size, (b, args.prompt_len), generator=g).cuda()
        gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                   do_sample=False)
        times, same = time_pair(model, gen, lambda b=b: DecodedTailStop(tok, "\n\n###NEVER###\n\n", args.prompt_len, b),
                                args.repeats)
        tok_s = {k: b * args.new_tokens / statistics.median(v) for k, v in times.items()}
        rows.append({"model": model_name, "batch": b, "plain_tok_s": tok_s["plain"], "harness_tok_s": tok_s["harness"],
                     "ratio": tok_s["harness"] / tok_s["plain"], "identical_tokens": same,
                     "plain_step_fraction_of_roofline": tok_s["plain"] / b / roofline, "samples_s": times})
    llmplug.unoptimize(model)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama-1b", "llama-8b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokenizer", default=str(TOKENIZER), help="a local tokenizer directory")
    p.add_argument("--out")
    p.add_argument("--commit", help="the tree's commit (the device's copy has no git history)")
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ceil = timing.ceilings("cuda")
    rows = []
    for m in args.models:
        rows += run(m, args.batches, args, tok, ceil)
        gc.collect()
        torch.cuda.empty_cache()  # the next model's KV pool is sized from free memory
    result = {"env": report.environment(), "ceilings": ceil, "commit": args.commit, "command": " ".join(sys.argv),
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'model':10} {'batch':>5} {'plain tok/s':>12} {'harness tok/s':>14} {'ratio':>6} {'same':>5} "
          f"{'% roofline':>10}")
    for r in rows:
        print(f"{r['model']:10} {r['batch']:>5} {r['plain_tok_s']:>12.1f} {r['harness_tok_s']:>14.1f} "
              f"{r['ratio']:>6.3f} {str(r['identical_tokens']):>5} {100 * r['plain_step_fraction_of_roofline']:>9.1f}%")


if __name__ == "__main__":
    main()
