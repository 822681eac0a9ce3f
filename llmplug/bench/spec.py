"""Speculative decoding's benchmark (``llmplug bench speculative``, ``benchmarks/spec_bench.py``): speculative
``generate`` against the same call without speculation, in one process.

``trained``: real acceptance of prompt lookup, the trained draft model and the trained EAGLE-3 head on the shipped
models, on input-grounded prompts made from held-out standard-library files (a near-copy of each file's continuation,
then the file's start); then the same prompts as Engine requests, plain, with prompt lookup and with the draft model.
``oracle``: acceptance on random weights means nothing, so the proposer replays the target's own greedy continuation
(from the plain run) with each draft corrupted at rate ``1 - alpha``; the weights are made decisive (:func:`decisive`)
so that bf16 greedy is reproducible and every output must equal the plain run's. With a draft model shape, the draft
model's real cost is paid while the oracle's tokens are proposed.
"""

from __future__ import annotations

import functools
import random
import statistics
import sysconfig
import time
import zlib
from pathlib import Path

import torch

import llmplug

from ..engine.params import EngineConfig, SamplingParams, SpeculativeConfig
from ..engine.sequences import SequenceBatch
from ..spec.proposers import DraftModelProposer
from ..state import ensure_state
from . import timing
from .sample import default_model
from .shapes import build, weight_bytes

DRAFT_NAME = "llmplug-stdlib-draft"
HEAD_NAME = "llmplug-stdlib-small-eagle3"


class OracleProposer:
    """Drafts from a known continuation (``rows[r]``: prompt + the target's greedy tokens), each replaced by another
    id with probability ``1 - alpha``. Optionally runs ``pay_for`` (a real proposer) first, for its cost only."""

    def __init__(self, rows: list[list[int]], alpha: float, vocab: int, seed: int = 0, pay_for=None) -> None:
        self.rows, self.alpha, self.vocab, self.pay_for = rows, alpha, vocab, pay_for
        self.rng = random.Random(seed)

    def propose(self, rows: list[int], histories: list[list[int]], k: int) -> list[list[int]]:
        if self.pay_for is not None:
            self.pay_for.propose(rows, histories, k)
        out = []
        for r in rows:
            true = self.rows[r][len(histories[r]):len(histories[r]) + k]
            out.append([t if self.rng.random() < self.alpha else (t + 1 + self.rng.randrange(self.vocab - 1))
                        % self.vocab for t in true])
        return out

    def release(self) -> None:
        if self.pay_for is not None:
            self.pay_for.release()


def decisive(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights whose greedy choice is far from ties, so that bf16 rounding differences between a decode step
    and a verify step never flip it (HF's initialisation gives near-uniform logits, and plain greedy itself then
    changes with the batch's kernels): the layers scaled down 100x, the LM head a copy of the embedding, so each
    step's argmax is its input token by a wide margin. Costs are those of the shape (no kernel reads values)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name and "lm_head" not in name:
                p.mul_(0.01)
        model.get_output_embeddings().weight.copy_(model.get_input_embeddings().weight)
    return model


def timed(fn, repeats: int, device) -> tuple[float, object]:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up, and the warm-up's result."""
    result = fn()
    times = []
    for _ in range(repeats):
        timing.sync(device)
        t0 = time.perf_counter()
        fn()
        timing.sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def held_out_files() -> list[Path]:
    """This Python's standard-library files the trained models never saw (``crc32(path) % 50 == 0``, their split),
    sorted by path."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts
                  and zlib.crc32(str(p.relative_to(lib)).encode()) % 50 == 0)


def grounded_prompts(tokenizer, n: int, head: int = 192, copy: int = 192) -> list[list[int]]:
    """Input-grounded prompts from :func:`held_out_files`: a near-copy (every 20th token changed) of the file's
    tokens ``[head, head + copy)``, a blank line, then the file's first ``head`` tokens to continue."""
    rng = random.Random(0)
    out = []
    for f in held_out_files():
        ids = tokenizer(f.read_text(errors="ignore"))["input_ids"]
        if len(ids) < head + copy:
            continue
        near = [t if i % 20 else rng.randrange(len(tokenizer)) for i, t in enumerate(ids[head:head + copy])]
        out.append(near + tokenizer("\n\n")["input_ids"] + ids[:head])
        if len(out) == n:
            break
    return out


def trained(device: str, dtype: torch.dtype, prompts: list[list[int]], batches=(1, 8), new_tokens: int = 256,
            k: int = 4, repeats: int = 3) -> list[dict]:
    """Prompt lookup, the trained draft model and the trained EAGLE-3 head on the shipped target, against plain
    decoding."""
    from ..loading import load_causal_lm

    path = default_model()
    if path is None:
        raise FileNotFoundError("the shipped models are not beside the package (a source checkout has them)")
    target = llmplug.optimize(load_causal_lm(str(path), device, dtype=dtype))
    draft = llmplug.optimize(load_causal_lm(str(path.parent / DRAFT_NAME), device, dtype=dtype))
    head = llmplug.load_eagle3(path.parent / HEAD_NAME, target, dtype=dtype)
    rows = []
    for b in batches:
        width = max(map(len, prompts[:b]))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts[:b]], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts[:b]], device=device)
        gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                   pad_token_id=0)
        base_s, ref = timed(functools.partial(target.generate, **gen), repeats, device)
        rows.append({"model": path.name, "batch": b, "proposer": "none", "tok_s": b * new_tokens / base_s})
        for name, extra in (("prompt lookup", dict(prompt_lookup_num_tokens=k)),
                            (DRAFT_NAME, dict(assistant_model=draft, num_assistant_tokens=k)),
                            (HEAD_NAME, dict(assistant_model=head, num_assistant_tokens=k))):
            secs, out = timed(functools.partial(target.generate, **gen, **extra), repeats, device)
            stats = llmplug.spec_stats(target)
            rows.append({"model": path.name, "batch": b, "proposer": name, "k": k, "tok_s": b * new_tokens / secs,
                         "speedup": base_s / secs, "identical": torch.equal(out, ref),
                         "acceptance": stats.acceptance_rate, "tokens_per_step": stats.tokens_per_step})
    rows += _engine_rows(target, draft, f"{path.name} (Engine)", prompts, batches, new_tokens, k, repeats, device)
    for m in (target, draft):
        llmplug.unoptimize(m)
    return rows


def _engine_rows(target, draft, label: str, prompts: list[list[int]], batches, new_tokens: int, k: int, repeats: int,
                 device: str) -> list[dict]:
    """The same prompts as requests of an :class:`~llmplug.Engine`: without speculation, with prompt lookup and with
    the draft model (``SpeculativeConfig``, adaptive draft counts), greedy, ``new_tokens`` each."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    configs = [("none", None), ("prompt lookup", SpeculativeConfig(num_tokens=k)),
               (DRAFT_NAME, SpeculativeConfig(method="draft", draft_model=draft, num_tokens=k))]
    rows = []
    for b in batches:
        base_s = ref = None
        for name, spec in configs:
            engine = llmplug.Engine(target, EngineConfig(speculative=spec))
            secs, outs = timed(functools.partial(engine.generate, prompts[:b], params, progress=False), repeats,
                               device)
            tokens = [o.outputs[0].token_ids for o in outs]
            row = {"model": label, "batch": b, "proposer": name, "tok_s": b * new_tokens / secs}
            if spec is None:
                base_s, ref = secs, tokens
            else:
                stats = engine.stats()["speculation"]
                row.update(k=k, speedup=base_s / secs, identical=tokens == ref, acceptance=stats["acceptance_rate"],
                           tokens_per_step=stats["tokens_per_verified_row"])
            engine.stop()
            rows.append(row)
    return rows


def oracle(model_name: str, ceil: dict, batches=(1, 8, 32, 64), alphas=(0.0, 0.5, 0.8, 0.95), k: int = 4,
           new_tokens: int = 256, repeats: int = 3, draft_shape: str | None = None,
           draft_batches=(1, 8)) -> list[dict]:
    """The oracle curve on a random-weight shape (CUDA), and a draft model shape's cost at ``alpha = 0.8``."""
    torch.manual_seed(0)
    model = llmplug.optimize(decisive(build(model_name, torch.bfloat16, "cuda")))
    roofline = ceil["read_bytes_per_s"] / weight_bytes(model)
    vocab = model.config.vocab_size
    draft = None
    if draft_shape:
        torch.manual_seed(1)
        draft = llmplug.optimize(build(draft_shape, torch.bfloat16, "cuda"))
    rows = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(3, vocab, (b, 128), generator=g).cuda()
        gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        base_s, ref = timed(functools.partial(model.generate, **gen), repeats, "cuda")
        ref_rows = ref.tolist()
        rows.append({"model": model_name, "batch": b, "proposer": "none", "tok_s": b * new_tokens / base_s,
                     "step_fraction_of_roofline": (new_tokens / base_s / roofline) if b == 1 else None})
        cases = [("oracle", a, None) for a in alphas]
        if draft is not None and b in draft_batches:
            cases.append(("draft " + draft_shape, 0.8, draft))
        for name, alpha, dmodel in cases:
            call = functools.partial(_oracle_call, model, gen, ref_rows, alpha, vocab, b, dmodel, k, new_tokens)
            secs, out = timed(call, repeats, "cuda")
            stats = llmplug.spec_stats(model)
            rows.append({"model": model_name, "batch": b, "proposer": name, "alpha": alpha, "k": k,
                         "tok_s": b * new_tokens / secs, "speedup": base_s / secs, "identical": torch.equal(out, ref),
                         "acceptance": stats.acceptance_rate, "tokens_per_step": stats.tokens_per_step,
                         "steps": stats.steps})
    for m in (model, draft):
        if m is not None:
            llmplug.unoptimize(m)
    return rows


def _oracle_call(model, gen: dict, ref_rows, alpha: float, vocab: int, seed: int, draft, k: int, new_tokens: int):
    """One speculative generate with the oracle's drafts (and a draft model's cost when ``draft`` is given)."""
    pay = None
    if draft is not None:
        ids = gen["input_ids"]
        pay = DraftModelProposer(SequenceBatch(ensure_state(draft).runner, ids, None, ids.shape[1] + new_tokens + k,
                                               prefix_cache=False))
    proposer = OracleProposer(ref_rows, alpha, vocab, seed=seed, pay_for=pay)
    return model.generate(**gen, assistant_model=proposer, num_assistant_tokens=k)


def table(rows: list[dict]) -> list[str]:
    """A markdown table of :func:`trained` / :func:`oracle` rows."""
    lines = ["| model | batch | proposer | alpha | tok/s | speed-up | acceptance | tokens a step | identical |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        spec = r["proposer"] != "none"
        lines.append(f"| {r['model']} | {r['batch']} | {r['proposer']} | {r.get('alpha', '')} | {r['tok_s']:,.1f} | "
                     + (f"{r['speedup']:.2f}x | {r['acceptance']:.2f} | {r['tokens_per_step']:.2f} | "
                        f"{'yes' if r['identical'] else 'NO'} |" if spec else "| | | |"))
    return lines
