"""Quantized llmplug vs llmplug bf16, one model, one process: batch-1 decode, batches of 8/32/64 (decode-heavy),
a prefill-heavy batch, and the KV pool's token capacity per ``kv_cache_dtype``.

The model is built once in bf16; each mode quantizes copies of its linears from those bf16 weights, then the
original modules are put back, so every mode starts from the same weights. Rooflines are each mode's bytes read
per decode step (quantized weights, scales, zeros, bf16 lm_head and one embedding row) over the measured read
bandwidth.

    python benchmarks/run_quant.py --model llama-8b --modes bf16 int8 int4 fp8 --out results.json --commit abc
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug.bench import report, timing  # noqa: E402
from llmplug.bench.shapes import build, weight_bytes  # noqa: E402
from llmplug.quant.quantize import QUANT_ATTR  # noqa: E402
from llmplug.state import state_of  # noqa: E402


def prompts(n: int, length: int, vocab: int, device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, length), generator=g)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}


def run_mode(model, mode: str, args, ceil: dict) -> dict:
    vocab = model.config.vocab_size
    originals = {n: m for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    t0 = time.perf_counter()
    exclude = {} if args.quantize_exclude is None else {"quantize_exclude": tuple(args.quantize_exclude)}
    llmplug.optimize(model, quantize=None if mode == "bf16" else mode, kv_cache_dtype=args.kv_cache_dtype,
                     kv_memory_fraction=args.kv_memory_fraction, **exclude)
    res = {"mode": mode, "step_bytes": weight_bytes(model), "quantize_s": time.perf_counter() - t0, **exclude}
    one = prompts(1, 128, vocab, "cuda", 1)
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False)
    model.generate(**one, **gen)
    t = timing.time_call(lambda: model.generate(**one, **gen), "cuda", repeats=args.repeats)
    res["b1_tok_s"] = args.new_tokens / t["median"]
    res["b1_roofline_tok_s"] = ceil["read_bytes_per_s"] / res["step_bytes"]
    res["b1_fraction_of_roofline"] = res["b1_tok_s"] / res["b1_roofline_tok_s"]
    res["b1_tokens"] = model.generate(**one, max_new_tokens=32, do_sample=False)[0, 128:].tolist()
    for b in args.batches:
        batch = prompts(b, 128, vocab, "cuda", 10 + b)
        t = timing.time_call(lambda batch=batch: model.generate(**batch, **gen), "cuda", repeats=1)
        res[f"batch{b}_tok_s"] = b * args.new_tokens / t["median"]
    heavy = prompts(args.prefill_batch, args.prefill_len, vocab, "cuda", 99)
    t = timing.time_call(lambda: model.generate(**heavy, max_new_tokens=args.prefill_new), "cuda", repeats=1)
    res["prefill_heavy_tok_s"] = args.prefill_batch * (args.prefill_len + args.prefill_new) / t["median"]
    cache = state_of(model).runner.cache
    res["kv_tokens_resident"] = cache.num_blocks * cache.block_size
    res["kv_pool_bytes"] = sum(x.numel() * x.element_size() for x in vars(cache).values()
                               if isinstance(x, torch.Tensor))
    llmplug.unoptimize(model)
    for name, mod in originals.items():  # back to the bf16 linears for the next mode
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, mod)
    model.__dict__.pop(QUANT_ATTR, None)
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--modes", nargs="+", default=["bf16", "int8", "int4", "fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantize-exclude", nargs="*", help="optimize's quantize_exclude (default: its own, lm_head); "
                    "given with no names, lm_head is quantized too")
    ap.add_argument("--kv-memory-fraction", type=float, default=0.3)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", nargs="*", type=int, default=[8, 32, 64])
    ap.add_argument("--prefill-batch", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--prefill-new", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--commit")
    args = ap.parse_args()
    ceil = timing.ceilings("cuda")
    model = build(args.model, torch.bfloat16, "cuda")
    out = {"env": {**report.environment(), "commit": args.commit or report.environment().get("commit")},
           "command": " ".join(sys.argv), "ceilings": ceil, "model": args.model, "modes": []}
    with torch.inference_mode():
        for mode in args.modes:
            r = run_mode(model, mode, args, ceil)
            out["modes"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "b1_tokens"}), flush=True)
    base = out["modes"][0]
    print(f"\n| mode | GB/step | b1 tok/s | x {base['mode']} | roofline | " +
          " | ".join(f"b{b} tok/s" for b in args.batches) + " | prefill-heavy tok/s | KV tokens |")
    for r in out["modes"]:
        print(f"| {r['mode']} | {r['step_bytes'] / 1e9:.2f} | {r['b1_tok_s']:.1f} | "
              f"{r['b1_tok_s'] / base['b1_tok_s']:.2f} | {100 * r['b1_fraction_of_roofline']:.1f}% | " +
              " | ".join(f"{r[f'batch{b}_tok_s']:.0f}" for b in args.batches) +
              f" | {r['prefill_heavy_tok_s']:.0f} | {r['kv_tokens_resident']} |")
    if args.out:
        report.save(out, args.out)


if __name__ == "__main__":
    main()
