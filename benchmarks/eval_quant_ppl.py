"""Held-out perplexity of the trained small model (models/llmplug-stdlib-small) under each quantization mode.

The held-out set is the one ``scripts/train_small_models.py`` held out (stdlib files with ``crc32(path) % 50 == 0``,
read from ``--corpus``, a copy of the Python 3.11 stdlib the model was trained on). Every mode runs through
llmplug's own forward (paged KV, fused kernels) in windows of ``--seq-len`` tokens, prefilled in chunks of
``--chunk`` tokens so that attention reads earlier chunks back from the (possibly fp8 / int8) KV pages.

    python benchmarks/eval_quant_ppl.py --corpus .corpus --out results.json
"""

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import llmplug  # noqa: E402
from llmplug.bench import report  # noqa: E402

MODES = {  # name -> optimize overrides
    "bf16": {},
    "int8": {"quantize": "int8"},
    "int4": {"quantize": "int4"},
    "fp8": {"quantize": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "int8-kv": {"kv_cache_dtype": "int8"},
    "int8+lm_head": {"quantize": "int8", "quantize_exclude": ()},
    "int4+lm_head": {"quantize": "int4", "quantize_exclude": ()},
}


def held_out_ids(tokenizer, corpus: Path) -> torch.Tensor:
    """The training script's validation stream: ``<bos> ids <eos>`` per held-out file, concatenated."""
    from train_small_models import encode_docs, split_files, stdlib_files

    _, val = split_files(stdlib_files(corpus=corpus))
    return torch.from_numpy(encode_docs(tokenizer.backend_tokenizer, [t for _, t in val]).astype("int64"))


@torch.inference_mode()
def window_nll(model, ids: torch.Tensor) -> tuple[float, int]:
    """Summed NLL of ``ids[1:]`` given the prefix, ``ids: (L,)``, prefilled through llmplug in chunks of the model's
    ``max_prefill_tokens``."""
    logits = llmplug.logits(model, ids[:-1]).float()
    return F.cross_entropy(logits, ids[1:], reduction="sum").item(), ids.numel() - 1


def perplexity(model, val: torch.Tensor, seq_len: int, max_windows: int | None) -> float:
    nll = count = 0
    starts = list(range(0, val.numel() - 1, seq_len))[:max_windows]
    for s in starts:
        a, b = window_nll(model, val[s:s + seq_len + 1])
        nll, count = nll + a, count + b
    return math.exp(nll / count)


def trained_model_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--model --corpus --device --dtype``: the trained model and the stdlib copy holding its held-out split."""
    ap.add_argument("--model", default=str(ROOT / "models" / "llmplug-stdlib-small"))
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    return ap


def load_trained(args) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model of ``args.model`` in ``args.dtype`` on ``args.device``, and its held-out token stream (on CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    return model, held_out_ids(AutoTokenizer.from_pretrained(args.model), args.corpus)


def main() -> None:
    ap = trained_model_args(argparse.ArgumentParser())
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--max-windows", type=int)
    ap.add_argument("--out")
    args = ap.parse_args()
    base, val = load_trained(args)
    val = val.to(args.device)
    res = {"model": args.model, "device": str(args.device), "dtype": args.dtype, "val_tokens": val.numel(),
           "seq_len": args.seq_len, "chunk": args.chunk, "ppl": {}, "quantized_linears": {}}
    for mode in args.modes:
        model = copy.deepcopy(base)
        llmplug.optimize(model, kv_num_blocks=4 * args.seq_len // 16 + 8, max_prefill_tokens=args.chunk, **MODES[mode])
        res["quantized_linears"][mode] = len(model.__dict__.get("_llmplug_quantization", {}).get("modules", []))
        res["ppl"][mode] = perplexity(model, val, args.seq_len, args.max_windows)
        llmplug.unoptimize(model)
        del model
        print(f"{mode:8s} ppl {res['ppl'][mode]:.4f} ({res['quantized_linears'][mode]} quantized linears)", flush=True)
    ref = res["ppl"].get("bf16")
    if ref:
        res["increase_pct"] = {m: 100 * (p / ref - 1) for m, p in res["ppl"].items()}
        print("\n| mode | held-out ppl | vs bf16 |\n| --- | --- | --- |")
        for m, p in res["ppl"].items():
            print(f"| {m} | {p:.4f} | {res['increase_pct'][m]:+.2f}% |")
    if args.out:
        report.save({**report.environment(), **res}, args.out)


if __name__ == "__main__":
    main()
