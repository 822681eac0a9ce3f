"""What a uniform step of ``1 + k`` tokens a row costs against a decode step (speculative verification's price).

For each batch size the rows' 128-token prompts are prefilled, then a uniform step of ``q`` tokens a row (every row's
logits, as verification needs) is replayed from its CUDA graph ``--replays`` times; the median of ``--repeats``
timings is reported with its ratio to ``q = 1``. ``accept`` adds the greedy acceptance and the host read of its
result, as :mod:`llmplug.spec.decode` does every step.

    python benchmarks/verify_cost.py --model llama-8b --batches 1 8 32 64 --queries 1 2 3 5 --out results.json
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug.bench.shapes import build  # noqa: E402
from llmplug.engine import step as step_module  # noqa: E402
from llmplug.engine.sequences import SequenceBatch  # noqa: E402
from llmplug.engine.step import build_step  # noqa: E402
from llmplug.ops import skinny_gemv  # noqa: E402
from llmplug.spec.rejection import greedy_accept  # noqa: E402
from llmplug.state import state_of  # noqa: E402


def time_ms(fn, replays: int, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / replays * 1e3)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--queries", nargs="+", type=int, default=[1, 2, 3, 5])
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skinny-rows", type=int, default=None,
                    help="set llmplug.ops.skinny_gemv.MAX_ROWS (1: cuBLAS for every multi-token step)")
    ap.add_argument("--decode-kernel-query", type=int, default=None,
                    help="set llmplug.engine.step.DECODE_KERNEL_QUERY (1: verify steps on the prefill kernel)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.skinny_rows is not None:
        skinny_gemv.MAX_ROWS = args.skinny_rows
    if args.decode_kernel_query is not None:
        step_module.DECODE_KERNEL_QUERY = args.decode_kernel_query
    torch.manual_seed(0)
    model = llmplug.optimize(build(args.model, torch.bfloat16, "cuda"))
    runner = state_of(model).runner
    rows = []
    for b in args.batches:
        ids = torch.randint(3, model.config.vocab_size, (b, 128), device="cuda")
        batch = SequenceBatch(runner, ids, None, 128 + max(args.queries) + 1, prefix_cache=False)
        batch.prefill()
        batch._grow(range(b), [128 + max(args.queries)] * b)
        base = None
        for q in args.queries:
            tokens = torch.randint(3, model.config.vocab_size, (b * q,), device="cuda")
            ctx = build_step(batch.seqs, [q] * b, batch.block_size, ids.device, input_ids=tokens,
                             block_tables=batch.block_table_dev, all_logits=True)
            step = time_ms(lambda ctx=ctx: runner.step(ctx), args.replays, args.repeats)
            drafts = tokens.view(b, q)[:, 1:]
            counts = torch.full((b,), q - 1, device="cuda")

            def verify(ctx=ctx, drafts=drafts, counts=counts, q=q, b=b):
                out, n = greedy_accept(runner.step(ctx).view(b, q, -1), drafts, counts)
                return out.tolist(), n.tolist()

            full = time_ms(verify, args.replays, args.repeats)
            base = base or step
            rows.append({"batch": b, "query_len": q, "step_ms": step, "step_and_accept_ms": full,
                         "ratio_to_decode": step / base})
            print(f"b{b} q{q}: step {step:.3f} ms ({step / base:.2f}x decode), with acceptance + read {full:.3f} ms",
                  flush=True)
        batch.release()
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "model": args.model,
                                        "skinny_max_rows": skinny_gemv.MAX_ROWS,
                                        "decode_kernel_query": step_module.DECODE_KERNEL_QUERY, "rows": rows},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
