"""End-to-end generate benchmarks: stock HF eager, stock HF static cache + torch.compile, and llmplug, one run."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import llmplug

from .shapes import build, weight_bytes
from .timing import sync, time_call

STATIC_BATCHES = (8, 32, 64)
TTFT_PROMPTS = (128, 1024, 8192)


def _random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lengths]


def _left_pad(rows: list[list[int]], device) -> dict:
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def row_agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Greedy continuations ``(B, N)``: fraction of rows identical, and where each row first differs."""
    same = (a == b).all(dim=1)
    first = [(x != y).nonzero()[0].item() if not ok else a.shape[1] for x, y, ok in zip(a, b, same.tolist())]
    return {"rows_identical": same.float().mean().item(), "first_divergence": first}


def _stock(model):
    return lambda **kw: type(model).generate(model, **kw)


def run(model_name: str, device: str, dtype: torch.dtype, *, new_tokens: int = 256, static: bool = True,
        ttft: bool = True, batches: tuple[int, ...] = STATIC_BATCHES, repeats: int = 3,
        stock_batches: bool = True, batch_prompts: tuple[int, int] = (32, 1024)) -> dict:
    """Measure batch-1 decode, TTFT, static batches and greedy agreement for stock HF and llmplug on one model.

    The static batches' prompt lengths are drawn from ``batch_prompts`` (inclusive), capped so that prompt plus
    ``new_tokens`` fits the model's positions.
    """
    model = build(model_name, dtype, device)
    vocab = model.config.vocab_size
    context = getattr(model.config, "max_position_embeddings", max(TTFT_PROMPTS) + 1)
    ttft_prompts = [n for n in TTFT_PROMPTS if n < context]
    lo, hi = batch_prompts[0], min(batch_prompts[1], context - new_tokens)
    res: dict = {"model": model_name, "dtype": str(dtype), "weight_bytes": weight_bytes(model),
                 "new_tokens": new_tokens, "batch_prompts": (lo, hi)}
    one = _left_pad(_random_prompts(1, 128, 128, vocab, seed=1), device)
    gen = dict(max_new_tokens=new_tokens, do_sample=False)
    agree_rows = _left_pad(_random_prompts(16, 64, 64, vocab, seed=2), device)
    stock = _stock(model)
    steps = ["stock eager b1", "stock static+compile b1" if static else None, "stock ttft" if ttft else None,
             "stock batches" if stock_batches else None, "llmplug warm-up", "llmplug b1",
             "llmplug ttft" if ttft else None, "llmplug batches", "agreement"]
    bar = tqdm(total=sum(s is not None for s in steps), desc=f"e2e {Path(model_name).name}")

    def step(name):
        bar.set_postfix_str(name)
        bar.update(1)

    res["stock_eager_b1"] = time_call(lambda: stock(**one, **gen), device, repeats=repeats)
    step("stock eager b1")
    if static:
        t0 = time.perf_counter()
        stock(**one, **gen, cache_implementation="static")
        sync(device)
        res["stock_static_compile_warmup_s"] = time.perf_counter() - t0
        res["stock_static_compile_b1"] = time_call(lambda: stock(**one, **gen, cache_implementation="static"),
                                                   device, repeats=repeats)
        step("stock static+compile b1")
        torch._dynamo.reset()
    batches_in = {b: _left_pad(_random_prompts(b, lo, hi, vocab, seed=10 + b), device) for b in batches}
    if ttft:
        res["stock_ttft"] = {n: time_call(lambda n=n: stock(**_left_pad(_random_prompts(1, n, n, vocab, 3), device),
                                                               max_new_tokens=1), device, repeats=repeats)
                             for n in ttft_prompts}
        step("stock ttft")
    if stock_batches:
        res["stock_batches"] = {b: time_call(lambda b=b: stock(**batches_in[b], **gen), device, repeats=1,
                                             warmup=0) for b in batches}
        step("stock batches")
    width = agree_rows["input_ids"].shape[1]
    stock_agree = stock(**agree_rows, max_new_tokens=32, do_sample=False)[:, width:]
    # The bf16 noise floor: stock HF against itself with another attention implementation.
    original = model.config._attn_implementation
    model.set_attn_implementation("eager")
    eager_agree = stock(**agree_rows, max_new_tokens=32, do_sample=False)[:, width:]
    eager_logits = model(input_ids=agree_rows["input_ids"]).logits
    model.set_attn_implementation(original)
    stock_logits = model(input_ids=agree_rows["input_ids"]).logits
    res["stock_eager_vs_sdpa"] = row_agreement(eager_agree, stock_agree)
    res["stock_eager_vs_sdpa"]["teacher_forced_argmax"] = (
        (eager_logits.argmax(-1) == stock_logits.argmax(-1)).float().mean().item())
    del eager_logits
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    t0 = time.perf_counter()
    llmplug.optimize(model)
    model.generate(**one, **gen)
    sync(device)
    res["llmplug_warmup_s"] = time.perf_counter() - t0
    step("llmplug warm-up")
    res["llmplug_b1"] = time_call(lambda: model.generate(**one, **gen), device, repeats=repeats)
    step("llmplug b1")
    if ttft:
        res["llmplug_ttft"] = {n: time_call(lambda n=n: model.generate(
            **_left_pad(_random_prompts(1, n, n, vocab, 3), device), max_new_tokens=1), device, repeats=repeats)
            for n in ttft_prompts}
        step("llmplug ttft")
    res["llmplug_batches"] = {b: time_call(lambda b=b: model.generate(**batches_in[b], **gen), device,
                                           repeats=repeats) for b in batches}
    step("llmplug batches")
    ours = model.generate(**agree_rows, max_new_tokens=32, do_sample=False)[:, width:]
    res["llmplug_vs_sdpa"] = row_agreement(ours, stock_agree)
    res["greedy_agreement_32"] = res["llmplug_vs_sdpa"]["rows_identical"]
    our_logits = llmplug.logits(model, agree_rows["input_ids"])
    res["llmplug_vs_sdpa"]["teacher_forced_argmax"] = (
        (our_logits.argmax(-1) == stock_logits.argmax(-1)).float().mean().item())
    res["llmplug_vs_sdpa"]["logits_rel_diff"] = (
        (our_logits.float() - stock_logits.float()).norm() / stock_logits.float().norm()).item()
    step("agreement")
    bar.close()
    if device.startswith("cuda"):
        res["llmplug_peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    res["batch_output_tokens"] = {b: b * new_tokens for b in batches}
    llmplug.unoptimize(model)
    return res
