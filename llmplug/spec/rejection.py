"""Exact rejection sampling of draft tokens (Leviathan et al., 2023; Chen et al., 2023).

A verify step gives, for each sequence, the target's distribution at each of its ``n`` draft positions and one more
(``p_0 .. p_n``, after every sampling option: temperature, top-k/p, min-p, penalties). Draft token ``x_i`` was drawn
from the proposer's ``q_i``. Walking the drafts in order, ``x_i`` is accepted with probability
``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection a token is drawn from the residual ``max(p_i - q_i, 0)``
(normalised) and the step ends; if all ``n`` are accepted, a bonus token is drawn from ``p_n``. Every emitted token is
then distributed exactly as sampling the target one token at a time. A deterministic proposer (n-gram lookup) has
``q_i`` one-hot on ``x_i``: acceptance is ``p_i(x_i)`` and the residual is ``p_i`` without ``x_i``.

Greedy rows need no randomness: a draft is accepted when it is the target's argmax, and the first mismatch emits the
argmax (:func:`greedy_accept`), which is token-identical to greedy decoding without drafts.
"""

from __future__ import annotations

import torch

__all__ = ["greedy_accept", "rejection_sample"]


def _uniform(shape: tuple[int, ...], device, generators: list[torch.Generator | None] | None) -> torch.Tensor:
    """``(B, ...)`` uniforms in [0, 1); row ``b`` from ``generators[b]`` where one is given."""
    u = torch.rand(shape, device=device)
    for b, g in enumerate(generators or []):
        if g is not None:
            u[b] = torch.rand(shape[1:], device=device, generator=g)
    return u


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None] | None) -> torch.Tensor:
    """One token per row of ``probs (B, V)`` (rows sum to 1, or to any positive mass): an exponential race,
    ``argmax(p / e)`` with ``e ~ Exp(1)``, which draws from ``p``."""
    e = torch.empty_like(probs).exponential_()
    for b, g in enumerate(generators or []):
        if g is not None:
            e[b].exponential_(generator=g)
    return (probs / e).argmax(-1)


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None = None,
                     generators: list[torch.Generator | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify each row's drafts against the target; see the module docstring.

    Args:
        target_probs: ``(B, K + 1, V)`` float, the target's distribution at each draft position and the one after.
        draft_tokens: ``(B, K)`` int64; row ``b`` uses its first ``num_drafts[b]``.
        num_drafts: ``(B,)`` int64 in ``[0, K]``.
        draft_probs: ``(B, K, V)`` the proposer's distributions, or None for a deterministic proposer (one-hot).
        generators: per-row generators (seeded requests) or None entries for the default generator.

    Returns:
        ``(tokens (B, K + 1) int64, num_emitted (B,) int64)``: row ``b`` emits ``tokens[b, :num_emitted[b]]`` (its
        accepted drafts, then the recovered or bonus token); the rest is -1. ``1 <= num_emitted[b] <= n_b + 1``.
    """
    rows, k = draft_tokens.shape
    dev = target_probs.device
    if target_probs.shape[:2] != (rows, k + 1) or (draft_probs is not None and draft_probs.shape[:2] != (rows, k)):
        raise ValueError(f"target_probs must be (B, K + 1, V) and draft_probs (B, K, V) for draft_tokens (B, K) = "
                         f"{(rows, k)}, got {tuple(target_probs.shape)} and "
                         f"{None if draft_probs is None else tuple(draft_probs.shape)}")
    steps = torch.arange(k, device=dev)
    live = steps[None] < num_drafts[:, None]  # (B, K) real draft positions
    drafts = draft_tokens.clamp_min(0)
    p_x = target_probs[:, :k].gather(2, drafts[..., None]).squeeze(2)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(2, drafts[..., None]).squeeze(2)
    accepted = _uniform((rows, k), dev, generators) * q_x < p_x  # u < p / q, without dividing by q
    ok = accepted & live
    # r = the first rejected (or the first missing) position: the number of drafts kept
    kept = torch.cat([~ok, ok.new_ones(rows, 1)], dim=1).to(torch.int8).argmax(dim=1)  # a sentinel after the last
    at = kept[:, None, None].expand(-1, 1, target_probs.shape[-1])
    p_r = target_probs.gather(1, at).squeeze(1)  # (B, V): p at the stop position
    rejected = kept < num_drafts
    residual = p_r
    if rejected.any():
        if draft_probs is None:
            q_r = torch.zeros_like(p_r).scatter_(1, drafts.gather(1, kept.clamp_max(k - 1)[:, None]), 1.0)
        else:
            q_r = draft_probs.gather(1, at.clamp_max(k - 1)).squeeze(1)
        residual = torch.where(rejected[:, None], (p_r - q_r).clamp_min(0), p_r)
        # p == q on the support leaves no residual; rejection then had probability 0 (keep p as a guard)
        empty = residual.sum(-1, keepdim=True) <= 0
        residual = torch.where(empty, p_r, residual)
    last = _draw(residual, generators)
    tokens = torch.where(steps[None] < kept[:, None], drafts, -1)
    tokens = torch.cat([tokens, torch.full((rows, 1), -1, dtype=tokens.dtype, device=dev)], dim=1)
    tokens.scatter_(1, kept[:, None], last[:, None])
    return tokens, kept + 1


def greedy_accept(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: ``target_logits (B, K + 1, V)``; drafts are kept while they equal the target's argmax,
    then the argmax at the first mismatch (or after the last draft) is emitted. Returns as :func:`rejection_sample`."""
    rows, k = draft_tokens.shape
    best = target_logits.argmax(-1)  # (B, K + 1)
    steps = torch.arange(k, device=best.device)
    ok = (best[:, :k] == draft_tokens) & (steps[None] < num_drafts[:, None])
    stop = torch.cat([~ok, ok.new_ones(rows, 1)], dim=1)  # a sentinel mismatch after the last draft
    kept = stop.to(torch.int8).argmax(dim=1)  # the first mismatch
    tokens = torch.where(torch.arange(k + 1, device=best.device)[None] <= kept[:, None], best, -1)
    return tokens, kept + 1
