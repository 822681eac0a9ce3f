"""The commands of ``llmplug`` (parsed in :mod:`llmplug_cli`, the console script's light entry point):
``llmplug bench`` compares stock HF and llmplug side by side; ``llmplug bench throughput`` runs the serving benchmark
of ``llmplug.Engine``."""

from __future__ import annotations

import sys

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _bench(args) -> int:
    from .bench import e2e, kernels, report, sample, timing

    cuda = args.device.startswith("cuda")
    trained = sample.default_model()
    # On CUDA the speed figures stay on Llama-3.2-1B's shape: the 8.4M-parameter model's 17 MB of bf16 weights put
    # its batch-1 roofline near 200k tok/s, so its decode would time launch overhead, not a real model's.
    model = args.model or ("llama-1b" if cuda else str(trained or "tiny-llama"))
    dtype = _DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    results = {"env": report.environment(), "ceilings": timing.ceilings(args.device)}
    quick = args.quick or not cuda
    # NOTE: small CPU sizes keep the command at ~11 s (2-core CPU, 2026-11-27; BENCHMARKS.md, "Figures moved from code")
    results["e2e"] = e2e.run(model, args.device, dtype, new_tokens=args.new_tokens or (256 if cuda else 32),
                             static=cuda and not args.no_static, ttft=not quick,
                             batches=(8,) if quick else e2e.STATIC_BATCHES, repeats=args.repeats,
                             batch_prompts=(32, 1024) if cuda else (32, 256))
    if args.kernels and cuda:
        results["prefill_attention"] = kernels.prefill()
        results["decode_attention"] = kernels.decode(read_bw=results["ceilings"]["read_bytes_per_s"])
    if trained is not None and not args.no_sample:
        results["sample"] = sample.run(trained, args.device, dtype)
    print("\n".join(report.e2e_table(results["e2e"], results["ceilings"])))
    if not cuda:
        print("(CPU: llmplug runs its pure-PyTorch reference path here, for correctness; its speed-ups are on CUDA)")
    if "sample" in results:
        print("\n".join(report.sample_lines(results["sample"])))
    elif not args.no_sample:
        print(f"(no text sample: models/{sample.MODEL_NAME} is not beside the package, as in a wheel install;"
              " a source checkout has it)")
    if args.out:
        print(f"saved {report.save(results, args.out)}")
    same = results["e2e"]["greedy_agreement_32"] == 1.0 and results.get("sample", {}).get("identical", True)
    if dtype == torch.float32:
        print(f"greedy outputs identical to stock HF: {'yes' if same else 'NO'}")
        return 0 if same else 1
    return 0


def _speculative(args) -> int:
    """``llmplug bench speculative``: :mod:`llmplug.bench.spec`'s trained section (and the oracle curve on CUDA)."""
    from transformers import AutoTokenizer

    from .bench import report, sample, spec, timing

    cuda = args.device.startswith("cuda")
    path = sample.default_model()
    if path is None:
        print(f"(no shipped models: models/{sample.MODEL_NAME} is not beside the package, as in a wheel install)")
        return 1
    dtype = _DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    new_tokens = args.new_tokens or (256 if cuda else 32)
    repeats = args.repeats if cuda else 1
    prompts = spec.grounded_prompts(AutoTokenizer.from_pretrained(path), max(args.prompts, *args.batches))
    results = {"env": report.environment(), "ceilings": timing.ceilings(args.device)}
    results["rows"] = spec.trained(args.device, dtype, prompts, tuple(args.batches), new_tokens, args.k, repeats)
    if args.oracle and cuda:
        results["rows"] += spec.oracle(args.model or "llama-1b", results["ceilings"], tuple(args.batches), k=args.k,
                                       new_tokens=new_tokens, repeats=repeats)
    print("\n".join(spec.table(results["rows"])))
    if not cuda:
        print("(CPU: llmplug runs its reference path, compute-bound, so speculation brings no speed here; acceptance "
              "and tokens a step carry over to a GPU, where a step is one weight read)")
    if args.out:
        print(f"saved {report.save(results, args.out)}")
    same = all(r.get("identical", True) for r in results["rows"])
    if dtype == torch.float32:
        print(f"speculative outputs identical to plain decoding: {'yes' if same else 'NO'}")
        return 0 if same else 1
    return 0


def _tp(args) -> int:
    """``llmplug bench tp``: launches itself under ``torchrun`` on ``--tp`` processes, then runs on each rank."""
    import os

    from .bench import report as reports
    from .bench import tp

    if "RANK" not in os.environ:
        return tp.launch(args.tp, args.argv)
    cuda = torch.cuda.is_available()
    report = tp.run(args.model or ("llama-8b" if cuda else "tiny-llama"), tuple(args.batches),
                    args.new_tokens or (256 if cuda else 16), args.repeats if cuda else 1, tuple(args.allreduce),
                    args.agreement, args.prompts, args.split_build)
    if report is not None:
        print("\n".join(tp.table(report)), flush=True)
        if args.out:
            print(f"saved {reports.save(report, args.out)}")
        if not cuda:
            print("(CPU: gloo between processes, for correctness; the speed-up is a multi-GPU story)")
        compared = [r["identical"] for r in report["rows"] if "identical" in r]
        if compared:
            print(f"split greedy outputs identical to one process: {'yes' if all(compared) else 'NO'}")
        return 0 if all(compared) else 1
    return 0


def _run(args) -> int:
    """Run the parsed command with ``--threads`` intra-op threads (on CPU one by default), restoring torch's count."""
    threads = args.threads if args.threads is not None else (1 if torch.device(args.device).type == "cpu" else None)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if args.bench_command == "throughput":
            from .bench import throughput

            return throughput.main(args)
        if args.bench_command == "speculative":
            return _speculative(args)
        if args.bench_command == "tp":
            return _tp(args)
        return _bench(args)
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) with the full parser and run the command."""
    from llmplug_cli import build_parser

    from .bench import throughput

    args = build_parser(throughput.add_arguments).parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a relaunch under torchrun passes on
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
