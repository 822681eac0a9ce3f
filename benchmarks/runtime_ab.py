"""Decode speed of the package this script is run from, for A/B runs of two trees on one GPU (issue 23, part 1).

Greedy ``generate`` of 128-token random prompts, 256 new tokens, on random bf16 weights: batch 1 and a static batch
per model shape; the median of ``--repeats`` timed calls after one warm-up, the share of the weight-read roofline at
batch 1, and a checksum of the tokens (two trees must produce the same ones). Run each tree in its own process:

    cd TREE && python benchmarks/runtime_ab.py --label old --out results.json --models llama-1b llama-8b
"""

import argparse
import gc
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import llmplug
from llmplug.bench import timing
from llmplug.bench.shapes import build, weight_bytes


def measure(name: str, batches: list[int], repeats: int, ceil: dict) -> list[dict]:
    torch.manual_seed(0)  # the same random weights in every tree's process
    model = llmplug.optimize(build(name, torch.bfloat16, "cuda"))
    roofline = ceil["read_bytes_per_s"] / weight_bytes(model)
    rows = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(3, model.config.vocab_size, (b, 128), generator=g).cuda()
        gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=256, do_sample=False)
        out = model.generate(**gen)  # warm-up: graphs captured, kernels compiled
        times = []
        for _ in range(repeats):
            timing.sync("cuda")
            t0 = time.perf_counter()
            model.generate(**gen)
            timing.sync("cuda")
            times.append(time.perf_counter() - t0)
        tok_s = b * 256 / statistics.median(times)
        rows.append({"model": name, "batch": b, "tok_s": tok_s, "samples_s": times,
                     "fraction_of_roofline": tok_s / b / roofline if b == 1 else None,
                     "tokens_sha1": hashlib.sha1(out.cpu().numpy().tobytes()).hexdigest()[:12]})
        print(f"{name} batch {b}: {tok_s:,.1f} tok/s", flush=True)
    llmplug.unoptimize(model)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True, help="name of this tree in the results (e.g. old, new)")
    ap.add_argument("--models", nargs="+", default=["llama-1b", "llama-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    ceil = timing.ceilings("cuda")
    rows = [r for name in args.models for r in measure(name, args.batches, args.repeats, ceil)]
    result = {"label": args.label, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "package": str(Path(llmplug.__file__).parent), "ceilings": ceil, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
