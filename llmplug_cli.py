"""``llmplug`` command line: ``llmplug bench`` compares stock HF and llmplug side by side; ``llmplug bench
throughput`` runs the serving benchmark of ``llmplug.Engine``; ``llmplug bench speculative`` speculative decoding's.

This module is the console script's entry point and imports nothing heavy: ``import llmplug`` loads torch and
transformers (it registers llmplug's quantizer with transformers, which takes seconds), so the arguments are parsed
here first, ``--help`` and usage errors are answered at once, and :mod:`llmplug.cli` runs the command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

DTYPES = ("bf16", "fp16", "fp32")
SAMPLE_MODEL = "models/llmplug-stdlib-small"  # llmplug.bench.sample.MODEL_NAME beside the checkout


def build_parser(throughput_arguments: Callable[[argparse.ArgumentParser], None] | None = None
                 ) -> argparse.ArgumentParser:
    """The ``llmplug`` parser. ``bench throughput`` takes its options from ``throughput_arguments``
    (:func:`llmplug.bench.throughput.add_arguments`); without it that subcommand declares none (:func:`main` leaves
    them to the full parser)."""
    parser = argparse.ArgumentParser(prog="llmplug", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="stock HF vs llmplug side by side: timings, then a text sample (no download)")
    b.add_argument("--model", help="what the timings run on: a random-weight shape (tiny-llama, llama-1b, llama-8b,"
                                   " qwen3-8b) or a local model directory; default llama-1b on CUDA, the trained"
                                   f" {SAMPLE_MODEL} on CPU (tiny-llama where it is missing)")
    b.add_argument("--device", help="default cuda where available, else cpu")
    b.add_argument("--dtype", choices=DTYPES, help="default bf16 on CUDA, fp32 on CPU")
    b.add_argument("--new-tokens", type=int, help="default 256 on CUDA, 32 on CPU")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--quick", action="store_true", help="skip TTFT and large static batches (always on CPU)")
    b.add_argument("--no-static", action="store_true", help="skip the stock static-cache + torch.compile baseline")
    b.add_argument("--kernels", action="store_true", help="also run the attention kernel microbenchmarks (CUDA)")
    b.add_argument("--no-sample", action="store_true",
                   help=f"skip the text sample (greedy continuations of Python prompts by {SAMPLE_MODEL})")
    b.add_argument("--out", help="write the full results as JSON here")
    # NOTE: one thread by default on CPU: as fast as two on the small CPU models, and no OpenMP region waits on a
    # thread another process has taken the core from (BENCHMARKS.md, "CPU threads beside a busy neighbour")
    b.add_argument("--threads", type=_positive, help="intra-op CPU threads (torch.set_num_threads); default 1 on "
                                                     "CPU, torch's own on CUDA")
    bench_sub = b.add_subparsers(dest="bench_command")
    spec = bench_sub.add_parser("speculative", help="speculative generate against plain: prompt lookup and the trained "
                                                    "draft model on the shipped models (CUDA: --oracle curve too)")
    spec.add_argument("--k", type=_positive, default=4, help="draft tokens a step at most (default 4)")
    spec.add_argument("--batches", type=_positive, nargs="+", default=[1, 8])
    spec.add_argument("--prompts", type=_positive, default=8, help="input-grounded prompts made from the stdlib")
    spec.add_argument("--oracle", action="store_true", help="CUDA: the oracle curve on --model (default llama-1b)")
    tp = bench_sub.add_parser("tp", help="tensor parallelism: --model split over --tp processes (torchrun, launched "
                                         "here) against one process; CPU: gloo on tiny-llama")
    tp.add_argument("--tp", type=_positive, default=2, help="processes (GPUs) to split over (default 2)")
    tp.add_argument("--batches", type=_positive, nargs="+", default=[1, 8])
    tp.add_argument("--allreduce", nargs="+", choices=["nccl", "one_shot"], default=["nccl", "one_shot"],
                    help="CUDA: split runs with every all-reduce on NCCL and/or small ones through symmetric memory")
    tp.add_argument("--agreement", metavar="DIR", help="also greedy agreement of this trained model with one process")
    tp.add_argument("--prompts", type=_positive, default=64, help="held-out prompts of --agreement")
    tp.add_argument("--split-build", action="store_true", help="build --model split from the start (shapes too big "
                                                               "for one GPU; no one-process run)")
    help_ = "serving benchmark of llmplug.Engine (workloads a-e, stock HF on a)"
    if throughput_arguments is None:
        bench_sub.add_parser("throughput", help=help_, add_help=False)
    else:
        throughput_arguments(bench_sub.add_parser("throughput", help=help_))
    return parser


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive whole number")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) here, then run the command with :func:`llmplug.cli.main`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.bench_command != "throughput":  # throughput's own options are parsed with the full parser
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from llmplug.cli import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
