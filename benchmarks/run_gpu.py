"""One device-machine call: ceilings, optional GPU tests, kernel microbenchmarks and end-to-end runs.

Usage: python benchmarks/run_gpu.py --models llama-1b llama-8b [--kernels] [--out DIR]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.bench import e2e, kernels, report, timing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=[])
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--no-static", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    out = Path(args.out)
    res = {"env": report.environment(), "ceilings": timing.ceilings("cuda")}
    print(res["env"], res["ceilings"], flush=True)
    lines = []
    if args.kernels:
        t0 = time.time()
        res["prefill_attention"] = kernels.prefill()
        res["decode_attention"] = kernels.decode(read_bw=res["ceilings"]["read_bytes_per_s"])
        report.save(res, out / "kernels.json")
        lines += report.kernel_table(res)
        print(f"kernels took {time.time() - t0:.0f} s", flush=True)
    for name in args.models:
        t0 = time.time()
        res[name] = e2e.run(name, "cuda", torch.bfloat16, static=not args.no_static, ttft=not args.quick,
                            batches=(8,) if args.quick else e2e.STATIC_BATCHES, repeats=args.repeats)
        report.save(res, out / f"e2e_{name}.json")
        lines += report.e2e_table(res[name], res["ceilings"])
        print(f"{name} took {time.time() - t0:.0f} s", flush=True)
        torch.cuda.empty_cache()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
