r"""Train llmplug's small trained models on the Python standard library's own sources.

No model hub is reachable from llmplug's machines, yet quantisation error and speculative-decoding acceptance only
mean something on trained weights. This script builds them from text every machine has, the ``.py`` files of the
running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``; ``site-packages`` and the
build-specific ``config-*`` / ``_sysconfigdata*`` files are left out):

1. a byte-level BPE tokenizer (``tokenizers``; ``<|bos|>``, ``<|eos|>``, ``<|pad|>``; adds ``<|bos|>`` in front of
   every text) saved in HF format, so ``AutoTokenizer.from_pretrained(dir)`` loads it;
2. ``llmplug-stdlib-small``: a ``LlamaForCausalLM`` of ~8.4M parameters (hidden 256, 8 layers, 4 query / 2 KV heads
   of dim 64, MLP 768, vocab 8192, tied embeddings, 1024 positions);
3. ``llmplug-stdlib-draft``: its ~1.6M-parameter sibling on the same tokenizer (hidden 128, 3 layers, 2 / 1 heads
   of dim 64, MLP 384) for speculative decoding. Every linear's input width is a multiple of 128, the usual
   quantisation group size.

Files are sorted by path; a file belongs to the held-out validation set when ``crc32(relative path) % 50 == 0``
(~2% of files, the same file on every machine). Each file becomes ``<|bos|> tokens <|eos|>``; all files are packed
into one stream that is cut into ``seq_len + 1`` windows at a fresh random offset each epoch. Training is plain
PyTorch: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to 10%, gradient
clipping at 1.0, bf16 autocast on CUDA and fp32 on CPU, seeded (bit-reproducible on CPU; on CUDA up to kernel
non-determinism and, with ``--time-budget-s``, up to where the clock stops). With a time budget the cosine runs on
``max(step / steps, elapsed / budget)``, so a run stopped by the clock still ends at the low learning rate. The
small model gets 70% of the budget, the draft what is left.

Outputs under ``--out`` (default ``models/`` at the repository root): both model directories (bf16 safetensors,
config, ``generation_config`` with bos/eos/pad ids, tokenizer) and ``train_report.json`` (device, versions, steps,
wall time, tokens seen, parameters, held-out token-level perplexity of both models beside a unigram baseline,
greedy samples). The two directories together must stay within ``--max-total-mb`` (25 MB) or the script fails.
The tokenizer and the encoded ids are cached under ``<out>/.cache/`` (git-ignored by a ``.gitignore`` it writes).

GPU command (one H100, from the repository root; 4 minutes of training plus well under a minute of tokenising,
evaluation and saving; the two directories come to ~21.2 MB)::

    python scripts/train_small_models.py --out models --device cuda --time-budget-s 240

Through the device tool, write under ``$OUT`` and leave the cache behind, then copy ``models/`` back into the repo::

    python scripts/train_small_models.py --out $OUT/models --device cuda --time-budget-s 240 \
        && rm -rf $OUT/models/.cache

CPU smoke run: ``python scripts/train_small_models.py --out /tmp/m --device cpu --max-files 30 --steps 3 \
--draft-steps 3 --hidden 64 --layers 2 --vocab-size 512 --seq-len 64``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SMALL_NAME, DRAFT_NAME = "llmplug-stdlib-small", "llmplug-stdlib-draft"
VAL_MODULUS = 50  # a file is held out when crc32(path) % VAL_MODULUS == 0: ~2% of files
MAIN_BUDGET_FRACTION = 0.7  # share of --time-budget-s given to the small model; the draft gets the rest
MAX_POSITIONS = 1024
CACHE_VERSION = "1"
SAMPLE_PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n",
                  "class Stack:\n    def __init__(self"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv`` defaults to ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    repo_models = Path(__file__).resolve().parent.parent / "models"
    p.add_argument("--out", type=Path, default=repo_models, help="output directory (default: <repo>/models)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=6000, help="optimizer steps of the small model (upper bound)")
    p.add_argument("--draft-steps", type=int, default=6000, help="optimizer steps of the draft (upper bound)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=1024, help=f"tokens per training sequence (<= {MAX_POSITIONS})")
    p.add_argument("--time-budget-s", type=float, default=None, help="stop training both models after this long")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary, special tokens included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N sorted files (tests)")
    p.add_argument("--corpus", type=Path, default=None,
                   help="a copied stdlib directory to read instead of this interpreter's own")
    p.add_argument("--max-total-mb", type=float, default=25.0, help="fail when both model dirs exceed this (1e6 B)")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    p.add_argument("--no-cache", action="store_true", help="rebuild the tokenizer and ids instead of reusing them")
    p.add_argument("--sample-tokens", type=int, default=64, help="new tokens per greedy sample at the end")
    for prefix, dims in (("", (256, 8, 4, 2, 768)), ("draft-", (128, 3, 2, 1, 384))):
        for name, default in zip(("hidden", "layers", "heads", "kv-heads", "intermediate"), dims):
            p.add_argument(f"--{prefix}{name}", type=int, default=default)
    args = p.parse_args(argv)
    if not 1 <= args.seq_len <= MAX_POSITIONS:
        p.error(f"--seq-len must be in [1, {MAX_POSITIONS}], got {args.seq_len}")
    if args.vocab_size < 256 + 3:
        p.error(f"--vocab-size must be >= 259 (256 bytes + 3 special tokens), got {args.vocab_size}")
    return args


# ----------------------------------------------------------------------------------------------------------- data
def stdlib_files(max_files: int | None = None, corpus: Path | None = None) -> list[tuple[str, str]]:
    """Return ``(relative path, text)`` of the stdlib's UTF-8 ``.py`` files, sorted by path.

    ``corpus``: a copy of some interpreter's stdlib to read instead of the running one's (to train on the same text on
    another machine).
    """
    root = corpus or Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        top = rel.parts[0]
        if top in ("site-packages", "dist-packages") or top.startswith("config-") or top.startswith("_sysconfigdata"):
            continue
        paths.append((rel.as_posix(), path))
    paths.sort()
    out = []
    for rel, path in paths:
        if max_files is not None and len(out) >= max_files:
            break
        try:
            out.append((rel, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately in other encodings
    return out


def split_files(files: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Split into (train, val): val holds files with ``crc32(path) % 50 == 0`` (the last file if none does), train
    the rest (at least the first file)."""
    if len(files) < 2:
        raise ValueError(f"need at least 2 files to hold one out, got {len(files)}")
    is_val = [zlib.crc32(rel.encode()) % VAL_MODULUS == 0 for rel, _ in files]
    if not any(is_val):
        is_val[-1] = True
    if all(is_val):
        is_val[0] = False
    train = [f for f, v in zip(files, is_val) if not v]
    val = [f for f, v in zip(files, is_val) if v]
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (special tokens get ids 0, 1, 2) that puts ``<|bos|>`` in front of every text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B:1",
                                                       special_tokens=[(BOS, bos)])
    return tok


def hf_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap ``tok`` as an HF fast tokenizer (left padding, for batched generation)."""
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   padding_side="left", model_max_length=MAX_POSITIONS)


def encode_docs(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Encode ``texts`` in one batch and pack them as ``<|bos|> ids <|eos|>`` ... -> (N,) uint16/int32."""
    eos = tok.token_to_id(EOS)
    dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.int32
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast (no offsets) since tokenizers 0.21
    encs = encode(texts, add_special_tokens=True)  # adds <|bos|>
    parts = []
    for enc in encs:
        parts.append(np.asarray(enc.ids, dtype=dtype))
        parts.append(np.asarray([eos], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def prepare_data(args: argparse.Namespace) -> tuple[Tokenizer, np.ndarray, np.ndarray, dict]:
    """Read the stdlib, train (or load the cached) tokenizer, encode -> (tokenizer, train ids, val ids, info)."""
    files = stdlib_files(args.max_files, args.corpus)
    train_files, val_files = split_files(files)
    key = hashlib.sha256(f"{CACHE_VERSION}|{args.vocab_size}".encode())
    for rel, text in files:
        key.update(rel.encode() + b"\0" + text.encode() + b"\0")
    cache = args.out / ".cache"
    tok_path, ids_path = cache / f"tokenizer-{key.hexdigest()[:16]}.json", cache / f"ids-{key.hexdigest()[:16]}.npz"
    if not args.no_cache and tok_path.exists() and ids_path.exists():
        print(f"data: reusing cached tokenizer and ids from {cache}", flush=True)
        tok = Tokenizer.from_file(str(tok_path))
        with np.load(ids_path, allow_pickle=False) as z:
            train_ids, val_ids = z["train"], z["val"]
    else:
        t0 = time.perf_counter()
        tok = train_tokenizer([t for _, t in train_files], args.vocab_size)
        t1 = time.perf_counter()
        train_ids, val_ids = encode_docs(tok, [t for _, t in train_files]), encode_docs(tok, [t for _, t in val_files])
        print(f"data: tokenizer trained in {t1 - t0:.1f}s, encoded in {time.perf_counter() - t1:.1f}s", flush=True)
        cache.mkdir(parents=True, exist_ok=True)
        (cache / ".gitignore").write_text("*\n")
        tok.save(str(tok_path))
        np.savez(ids_path, train=train_ids, val=val_ids)
    n_bytes = sum(len(t.encode()) for _, t in train_files)
    info = {
        "stdlib": str(args.corpus or sysconfig.get_paths()["stdlib"]), "python": platform.python_version(),
        "train_files": len(train_files), "val_files": len(val_files), "val_file_list": [r for r, _ in val_files],
        "train_tokens": int(train_ids.size), "val_tokens": int(val_ids.size), "train_bytes": n_bytes,
        "bytes_per_token": round(n_bytes / max(1, train_ids.size), 3),
    }
    return tok, train_ids, val_ids, info


def batches(data: torch.Tensor, seq_len: int, batch_size: int, seed: int):
    """Yield (B, seq_len + 1) windows of the packed stream ``data`` (N,), shuffled, new random offset per epoch."""
    rng = np.random.default_rng(seed)
    n = data.numel()
    ar = torch.arange(seq_len + 1, device=data.device)
    while True:
        offset = int(rng.integers(seq_len)) if n > 2 * (seq_len + 1) else 0
        n_chunks = (n - offset - 1) // seq_len
        if n_chunks < 1:
            raise ValueError(f"{n} training tokens are too few for --seq-len {seq_len}")
        bs = min(batch_size, n_chunks)
        starts = torch.from_numpy(offset + rng.permutation(n_chunks) * seq_len).to(data.device)
        for i in range(0, n_chunks - bs + 1, bs):
            yield data[starts[i:i + bs, None] + ar]


# ---------------------------------------------------------------------------------------------------------- model
def model_config(args: argparse.Namespace, prefix: str, tok: PreTrainedTokenizerFast) -> LlamaConfig:
    """The ``LlamaConfig`` for the small model (``prefix=""``) or the draft (``prefix="draft_"``)."""
    hidden, heads = getattr(args, prefix + "hidden"), getattr(args, prefix + "heads")
    if hidden % heads:
        raise ValueError(f"--{prefix.replace('_', '-')}hidden {hidden} is not a multiple of heads {heads}")
    return LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=getattr(args, prefix + "intermediate"),
        num_hidden_layers=getattr(args, prefix + "layers"), num_attention_heads=heads,
        num_key_value_heads=getattr(args, prefix + "kv_heads"), head_dim=hidden // heads,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )


def autocast(device: torch.device):
    """bf16 autocast on CUDA, nothing (fp32) elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_at(step: int, progress: float, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from ``peak`` to ``min_ratio * peak`` over ``progress``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return peak * (min_ratio + (1.0 - min_ratio) * cos)


def train_model(model: torch.nn.Module, data: torch.Tensor, args: argparse.Namespace, steps: int,
                budget_s: float | None, seed: int, desc: str) -> dict:
    """Train ``model`` in place on the packed stream ``data`` (N,) int64; return step/time/token counts."""
    device = data.device
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    forward = torch.compile(model) if args.compile else model
    warmup = min(args.warmup_steps, steps // 5)
    stream = batches(data, args.seq_len, args.batch_size, seed)
    model.train()
    stopped_by, step, tokens, loss_val = "steps", 0, 0, float("nan")
    t0 = time.perf_counter()
    bar = tqdm(total=steps, desc=desc, mininterval=1.0, dynamic_ncols=True)
    while step < steps:
        elapsed = time.perf_counter() - t0
        if budget_s is not None and elapsed >= budget_s:
            stopped_by = "time_budget"
            break
        progress = max(step / steps, elapsed / budget_s if budget_s else 0.0)
        lr = lr_at(step, progress, args.lr, warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = next(stream)
        with autocast(device):
            logits = forward(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += batch[:, 1:].numel()
        if step % 25 == 0 or step == steps:
            loss_val = loss.item()
            bar.set_postfix(loss=f"{loss_val:.3f}", lr=f"{lr:.2e}")
        bar.update(1)
    loss_val = loss.item() if step else loss_val
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    bar.close()
    model.eval()
    return {"steps": step, "stopped_by": stopped_by, "wall_time_s": round(wall, 2), "tokens_seen": tokens,
            "epochs": round(tokens / max(1, data.numel()), 3), "tokens_per_s": round(tokens / max(wall, 1e-9)),
            "final_train_loss": round(loss_val, 4) if step else None}


@torch.no_grad()
def eval_ppl(model: torch.nn.Module, val: torch.Tensor, seq_len: int, batch_size: int) -> float:
    """Token-level perplexity of ``model`` on the stream ``val`` (N,): windows of ``seq_len`` at stride ``seq_len``
    predict every token of ``val[1:]`` once (context restarts at each window)."""
    device = val.device
    n = val.numel() - 1
    full = n // seq_len
    nll, count = 0.0, 0
    spans = [(i * seq_len, batch_size) for i in range(0, full, batch_size)]
    ar = torch.arange(seq_len + 1, device=device)
    for start, bs in spans:
        bs = min(bs, full - start // seq_len)
        win = val[start + torch.arange(bs, device=device)[:, None] * seq_len + ar]
        with autocast(device):
            logits = model(input_ids=win[:, :-1], use_cache=False).logits
        nll += F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten(), reduction="sum").item()
        count += win[:, 1:].numel()
    if full * seq_len < n:
        win = val[full * seq_len:][None]
        with autocast(device):
            logits = model(input_ids=win[:, :-1], use_cache=False).logits
        nll += F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten(), reduction="sum").item()
        count += win[:, 1:].numel()
    return math.exp(nll / max(1, count))


def unigram_ppl(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Perplexity on ``val[1:]`` of add-one-smoothed token frequencies counted on ``train``."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(math.exp(-logp[val[1:].astype(np.int64)].mean()))


@torch.no_grad()
def greedy_samples(model: torch.nn.Module, tok: PreTrainedTokenizerFast, new_tokens: int) -> dict[str, str]:
    """Greedy continuations of ``SAMPLE_PROMPTS``."""
    device = next(model.parameters()).device
    out = {}
    for prompt in SAMPLE_PROMPTS:
        enc = tok(prompt, return_tensors="pt").to(device)
        ids = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False)
        out[prompt] = tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def save(model: torch.nn.Module, tok: PreTrainedTokenizerFast, path: Path) -> None:
    """Save ``model`` in bf16 safetensors with its tokenizer and a generation config into a fresh ``path``; its
    config says fp32, so a plain ``from_pretrained`` loads fp32 (the CPU path's dtype; bf16 widens exactly)."""
    if path.exists():
        shutil.rmtree(path)
    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    # "PreTrainedTokenizerFast" (an alias of TokenizersBackend in transformers 5) also loads in transformers 4.
    tok_config = path / "tokenizer_config.json"
    tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()),
                                      "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    config = path / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "dtype": "float32"}, indent=2) + "\n")
    pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    if pickles or not any(p.suffix == ".safetensors" for p in path.iterdir()):
        raise RuntimeError(f"{path} must hold safetensors weights only, found {sorted(os.listdir(path))}")


def dir_bytes(path: Path) -> int:
    """Total size of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def check_size(paths: list[Path], max_total_mb: float) -> dict[str, int]:
    """Return each dir's size in bytes; raise ``RuntimeError`` when together they exceed ``max_total_mb`` (1e6 B)."""
    sizes = {p.name: dir_bytes(p) for p in paths}
    total = sum(sizes.values())
    if total > max_total_mb * 1e6:
        raise RuntimeError(f"model files take {total / 1e6:.2f} MB > the {max_total_mb} MB limit: {sizes}")
    return sizes


# ----------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    """Build the tokenizer, train both models, evaluate, save; return the report (also written as JSON)."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    raw_tok, train_np, val_np, data_info = prepare_data(args)
    tok = hf_tokenizer(raw_tok)
    data_s = time.perf_counter() - t_start
    print(f"data: {data_info['train_files']} train / {data_info['val_files']} val files, "
          f"{data_info['train_tokens']:,} / {data_info['val_tokens']:,} tokens, "
          f"{data_info['bytes_per_token']} bytes/token ({data_s:.1f}s)", flush=True)
    train_ids = torch.from_numpy(train_np.astype(np.int64)).to(device)
    val_ids = torch.from_numpy(val_np.astype(np.int64)).to(device)
    uni = unigram_ppl(train_np, val_np, len(tok))
    print(f"unigram val ppl: {uni:.2f}", flush=True)

    t_train = time.perf_counter()
    results, dirs, trained_s = {}, [], 0.0
    for name, prefix, steps, seed in ((SMALL_NAME, "", args.steps, args.seed),
                                      (DRAFT_NAME, "draft_", args.draft_steps, args.seed + 1)):
        budget = None
        if args.time_budget_s is not None:
            frac = MAIN_BUDGET_FRACTION if not prefix else 1.0
            budget = max(0.0, args.time_budget_s * frac - trained_s)
        torch.manual_seed(seed)
        config = model_config(args, prefix, tok)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
        n_params = sum(p.numel() for p in model.parameters())
        limit = f"{budget:.0f}s or " if budget is not None else ""
        print(f"{name}: {n_params:,} parameters; training for {limit}{steps} steps", flush=True)
        stats = train_model(model, train_ids, args, steps, budget, seed, name)
        trained_s += stats["wall_time_s"]
        ppl_train_precision = eval_ppl(model, val_ids, args.seq_len, args.batch_size)
        path = args.out / name
        save(model, tok, path)  # casts to bf16
        ppl = eval_ppl(model, val_ids, args.seq_len, args.batch_size)
        samples = greedy_samples(model, tok, args.sample_tokens)
        print(f"{name}: val ppl {ppl:.3f} (bf16 weights; {ppl_train_precision:.3f} in training precision), "
              f"unigram {uni:.2f}; {stats}", flush=True)
        for prompt, text in samples.items():
            print(f"--- {name} greedy sample ---\n{prompt}{text}\n", flush=True)
        results[name] = {
            "dir": str(path), "params": n_params, "bf16_bytes": 2 * n_params,
            "config": {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                       "num_hidden_layers", "num_attention_heads",
                                                       "num_key_value_heads", "head_dim", "max_position_embeddings")},
            **stats, "val_ppl": round(ppl, 4), "val_ppl_train_precision": round(ppl_train_precision, 4),
            "samples": samples,
        }
        dirs.append(path)
        del model
    sizes = check_size(dirs, args.max_total_mb)

    report = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "numpy": np.__version__},
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "data": data_info, "data_prep_s": round(data_s, 2),
        "tokenizer": {"vocab_size": len(tok), "bos": tok.bos_token_id, "eos": tok.eos_token_id,
                      "pad": tok.pad_token_id},
        "unigram_val_ppl": round(uni, 4),
        "models": results,
        "train_wall_time_s": round(time.perf_counter() - t_train, 2),
        "total_wall_time_s": round(time.perf_counter() - t_start, 2),
        "size_bytes": sizes, "total_size_bytes": sum(sizes.values()),
    }
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out / 'train_report.json'}; model files {report['total_size_bytes'] / 1e6:.2f} MB", flush=True)
    return report


if __name__ == "__main__":
    main()
