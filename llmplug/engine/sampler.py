"""Per-request sampling for a whole batch: each row has its own penalties, temperature, filters and seed.

Order (as HF applies its processors): min-new-tokens mask, repetition penalty, frequency/presence penalties, then
greedy rows take the argmax; sampled rows go through temperature, top-k, top-p, min-p and draw with an exponential
race (``argmax(p / q)``, ``q ~ Exp(1)``), which equals drawing from ``p``. A seeded row draws its ``q`` from its own
generator, so its samples do not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from ..ops.argmax import argmax
from .request import Sequence
from .step import device_tensor, to_device


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """``rows`` as one ``(R, longest)`` int64 tensor, padded with ``pad``."""
    out = torch.full((len(rows), max(max(map(len, rows)), 1)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return to_device(out, device)


def _penalize(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Apply min-new-tokens masks and penalties in place to ``logits (B, V) float32``.

    Token lists are padded with index ``V``, a scratch column appended to the rows worked on.
    """
    dev, vocab = logits.device, logits.shape[1]
    for i, s in enumerate(seqs):
        if s.num_output < s.request.params.min_new_tokens and s.request.stop_ids:
            logits[i, list(s.request.stop_ids)] = -float("inf")
    rep = [i for i, s in enumerate(seqs) if s.request.params.repetition_penalty != 1.0]
    if rep:
        rows = device_tensor(rep, dev)
        ids = _padded([seqs[i].tokens for i in rep], vocab, dev)
        penalty = device_tensor([seqs[i].request.params.repetition_penalty for i in rep], dev)[:, None]
        work = torch.nn.functional.pad(logits[rows], (0, 1))
        score = work.gather(1, ids)
        work.scatter_(1, ids, torch.where(score < 0, score * penalty, score / penalty))
        logits[rows] = work[:, :vocab]
    add = [i for i, s in enumerate(seqs) if s.request.params.frequency_penalty or s.request.params.presence_penalty]
    if add:
        rows = device_tensor(add, dev)
        ids = _padded([seqs[i].output_ids for i in add], vocab, dev)
        counts = torch.zeros(len(add), vocab + 1, device=dev).scatter_add_(1, ids, torch.ones(ids.shape, device=dev))
        counts = counts[:, :vocab]
        freq, pres = device_tensor([[seqs[i].request.params.frequency_penalty for i in add],
                                    [seqs[i].request.params.presence_penalty for i in add]], dev)[:, :, None]
        logits[rows] -= freq * counts + pres * (counts > 0)


def _filtered(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled rows' distributions after temperature, top-k, top-p and min-p: ``logits (R, V) float32`` ->
    ``(probs, order)``, both ``(R, V)`` in descending logit order (``order`` maps them back to token ids)."""
    dev = logits.device
    params = [s.request.params for s in seqs]
    temp, top_p, min_p = device_tensor([[p.temperature for p in params], [p.top_p for p in params],
                                        [p.min_p for p in params]], dev)[:, :, None]
    top_k = device_tensor([p.top_k or logits.shape[1] for p in params], dev)[:, None]
    ordered, order = torch.sort(logits / temp, dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=dev)[None]
    ordered = ordered.masked_fill(rank >= top_k, -float("inf"))
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of the tokens ranked above
    ordered = ordered.masked_fill((before >= top_p) & (rank > 0), -float("inf"))
    probs = ordered.softmax(-1)
    ordered = ordered.masked_fill(probs < min_p * probs[:, :1], -float("inf"))
    return ordered.softmax(-1), order


def generator_of(seq: Sequence, device: torch.device) -> torch.Generator | None:
    """A seeded sequence's own generator on ``device`` (made on first use), None for unseeded ones."""
    if seq.seed is not None and seq.generator is None:
        seq.generator = torch.Generator(device).manual_seed(seq.seed)
    return seq.generator


def _filter_and_draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Sampled rows: ``logits (R, V) float32`` -> tokens ``(R,)``."""
    probs, order = _filtered(logits, seqs)
    q = torch.empty_like(probs).exponential_()
    for i, s in enumerate(seqs):
        g = generator_of(s, logits.device)
        if g is not None:
            q[i].exponential_(generator=g)
    picked = (probs / q).argmax(-1)
    return order.gather(1, picked[:, None]).squeeze(1)


def sampling_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """What :func:`sample` draws from for sampled rows without penalties: ``logits (R, V)`` -> probabilities
    ``(R, V)`` float32 in token order (speculative verification's target distribution)."""
    probs, order = _filtered(logits.to(torch.float32), seqs)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Next token of each row: ``logits (B, V)`` (row ``i`` belongs to ``seqs[i]``) -> ``(B,)`` int64 on device."""
    plain = all(s.request.params.plain_greedy or s.request.params.greedy and not s.request.params.penalised
                and s.num_output >= s.request.params.min_new_tokens for s in seqs)
    if plain:
        return argmax(logits)
    logits = logits.to(torch.float32, copy=True)  # the runner's logits buffer is reused
    _penalize(logits, seqs)
    tokens = logits.argmax(-1)  # torch's: a rarer path with several torch ops already (the op pays on plain greedy)
    drawn = [i for i, s in enumerate(seqs) if not s.request.params.greedy]
    if drawn:
        rows = device_tensor(drawn, logits.device)
        tokens[rows] = _filter_and_draw(logits[rows], [seqs[i] for i in drawn])
    return tokens
