"""Greedy decoding's per-step bookkeeping on the device, so that a whole decode step fits in one CUDA graph.

For every row ``b`` of ``logits (B, V)``, in place on the decode loop's state:

    next = argmax(logits[b])                     first index of the maximum; NaN counts as +inf
    next = next if unfinished[b] else pad        HF's finished rows emit the pad token
    unfinished[b] &= next not in eos
    ring[b, step % R] = next;  input_ids[b] = next
    positions[b] += 1 where positions[b] >= 0    -1 marks a padding row of a CUDA graph's batch bucket
    positions[b] = -1 where it reached limits[b]  a row that stops on its length computes nothing more
    counters = (step + 1, step + 1 if any row was unfinished before this step, else n_tokens)

``counters (2,) int64`` holds ``(step, n_tokens)``: ``n_tokens`` counts the steps whose tokens HF's loop keeps (it
stops after the step in which the last row finishes). Two kernels: a split argmax (``B x S`` programs, one block of
the vocabulary each: :func:`~llmplug.ops.argmax.argmax_parts`) and a single program that combines the partial maxima
and updates the state.
:func:`advance_step` is the second half alone, for tokens chosen otherwise (sampling).
"""

from __future__ import annotations

import torch

from ._triton import call_op, llmplug_op, maybe_wrap, next_pow2, pdl_options, tl, triton, use_triton, wait_inputs
from .argmax import argmax_parts

NO_LIMIT = 1 << 62  # a row's ``limits`` entry when its length does not stop it on the device


def greedy_step_ref(logits: torch.Tensor, unfinished: torch.Tensor, eos: torch.Tensor, pad: torch.Tensor,
                    ring: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, limits: torch.Tensor,
                    counters: torch.Tensor) -> None:
    """Reference, in place (see the module docstring); no host synchronisation, so it can be graph-captured."""
    x = logits.float()
    best = torch.argmax(torch.where(torch.isnan(x), float("inf"), x), dim=-1)
    advance_step_ref(best, unfinished, eos, pad, ring, input_ids, positions, limits, counters)


def advance_step_ref(tokens: torch.Tensor, unfinished: torch.Tensor, eos: torch.Tensor, pad: torch.Tensor,
                     ring: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, limits: torch.Tensor,
                     counters: torch.Tensor) -> None:
    """Reference of :func:`advance_step`: the module docstring's update with ``next = tokens``."""
    nxt = torch.where(unfinished, tokens, pad)
    step = counters[:1]
    alive = unfinished.any()
    unfinished &= ~torch.isin(nxt, eos)
    ring.index_copy_(1, step % ring.shape[1], nxt[:, None])
    input_ids.copy_(nxt)
    nxt_pos = torch.where(positions >= 0, positions + 1, positions)
    positions.copy_(torch.where(nxt_pos >= limits, -1, nxt_pos))
    counters.copy_(torch.stack([counters[0] + 1, torch.where(alive, counters[0] + 1, counters[1])]))


if triton is not None:

    @triton.jit
    def _greedy_update_kernel(vals_ptr, idx_ptr, unf_ptr, eos_ptr, pad_ptr, ring_ptr, ids_ptr, pos_ptr, lim_ptr,
                              cnt_ptr, B, S, R, CHOSEN: tl.constexpr, NUM_EOS: tl.constexpr, BLOCK_B: tl.constexpr,
                              BLOCK_S: tl.constexpr, PDL: tl.constexpr):
        # CHOSEN: idx_ptr holds each row's token (B,) int64, vals_ptr is unused; else the (B, S) partial maxima
        wait_inputs(PDL)
        step = tl.load(cnt_ptr)
        n_tokens = tl.load(cnt_ptr + 1)
        pad = tl.load(pad_ptr)
        eos = tl.load(eos_ptr + tl.arange(0, NUM_EOS))  # padded with -1, never a token id
        parts = tl.arange(0, BLOCK_S)
        alive = tl.zeros((), dtype=tl.int32)
        for b0 in range(0, B, BLOCK_B):
            rows = b0 + tl.arange(0, BLOCK_B)
            row_mask = rows < B
            if CHOSEN:
                first = tl.load(idx_ptr + rows, mask=row_mask, other=0)
            else:
                mask = row_mask[:, None] & (parts < S)[None, :]
                offs = rows[:, None] * S + parts[None, :]
                vals = tl.load(vals_ptr + offs, mask=mask, other=float("-inf"))
                idx = tl.load(idx_ptr + offs, mask=mask, other=2147483647)
                best = tl.max(vals, axis=1)
                # partial p covers lower columns than p + 1, so the smallest index among the maxima is the first one
                first = tl.min(tl.where(vals == best[:, None], idx, 2147483647), axis=1)
            unf = tl.load(unf_ptr + rows, mask=row_mask, other=0).to(tl.int32)
            nxt = tl.where(unf != 0, first.to(tl.int64), pad)
            hit = tl.max((nxt[:, None] == eos[None, :]).to(tl.int32), axis=1)
            tl.store(unf_ptr + rows, (unf * (1 - hit)) != 0, mask=row_mask)
            tl.store(ring_ptr + rows.to(tl.int64) * R + step % R, nxt, mask=row_mask)
            tl.store(ids_ptr + rows, nxt, mask=row_mask)
            pos = tl.load(pos_ptr + rows, mask=row_mask, other=-1)
            pos = tl.where(pos >= 0, pos + 1, pos)
            lim = tl.load(lim_ptr + rows, mask=row_mask, other=0)
            tl.store(pos_ptr + rows, tl.where(pos >= lim, -1, pos), mask=row_mask)
            alive = tl.maximum(alive, tl.max(unf, axis=0))
        tl.store(cnt_ptr, step + 1)
        tl.store(cnt_ptr + 1, tl.where(alive > 0, step + 1, n_tokens))


@llmplug_op("greedy_step", mutates_args=("unfinished", "ring", "input_ids", "positions", "counters"))
def _greedy_step_op(logits: torch.Tensor, unfinished: torch.Tensor, eos: torch.Tensor, pad: torch.Tensor,
                    ring: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, limits: torch.Tensor,
                    counters: torch.Tensor) -> None:
    if not use_triton(logits):
        greedy_step_ref(logits, unfinished, eos, pad, ring, input_ids, positions, limits, counters)
        return
    assert logits.stride(1) == 1 and ring.is_contiguous() and eos.numel() == next_pow2(eos.numel())
    pdl = pdl_options(logits)
    vals, idx = argmax_parts(logits, pdl)
    _launch_update(vals, idx, unfinished, eos, pad, ring, input_ids, positions, limits, counters, pdl, chosen=False)


@_greedy_step_op.register_fake
def _(logits, unfinished, eos, pad, ring, input_ids, positions, limits, counters):
    return None


def _launch_update(vals, idx, unfinished, eos, pad, ring, input_ids, positions, limits, counters, pdl: dict,
                   chosen: bool) -> None:
    """The state update: from the partial maxima ``vals, idx (B, S)``, or (``chosen``) from tokens ``idx (B,)``."""
    rows, parts = (idx.shape[0], 1) if chosen else vals.shape
    block_s = next_pow2(parts)
    block_b = max(1, min(next_pow2(rows), 8192 // block_s))
    maybe_wrap(_greedy_update_kernel)[(1,)](vals, idx, unfinished, eos, pad, ring, input_ids, positions, limits,
                                            counters, rows, parts, ring.shape[1], CHOSEN=chosen, NUM_EOS=eos.numel(),
                                            BLOCK_B=block_b, BLOCK_S=block_s, num_warps=4, **pdl)


@llmplug_op("advance_step", mutates_args=("unfinished", "ring", "input_ids", "positions", "counters"))
def _advance_step_op(tokens: torch.Tensor, unfinished: torch.Tensor, eos: torch.Tensor, pad: torch.Tensor,
                     ring: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, limits: torch.Tensor,
                     counters: torch.Tensor) -> None:
    if not use_triton(tokens):
        advance_step_ref(tokens, unfinished, eos, pad, ring, input_ids, positions, limits, counters)
        return
    assert ring.is_contiguous() and tokens.is_contiguous() and eos.numel() == next_pow2(eos.numel())
    _launch_update(tokens, tokens, unfinished, eos, pad, ring, input_ids, positions, limits, counters,
                   pdl_options(tokens), chosen=True)  # vals: a placeholder, never read


@_advance_step_op.register_fake
def _(tokens, unfinished, eos, pad, ring, input_ids, positions, limits, counters):
    return None


def _check_state(rows, unfinished, eos, ring, input_ids, positions, limits, counters) -> None:
    if eos.numel() != next_pow2(eos.numel()):
        raise ValueError(f"eos must hold a power of two of ids (pad with -1), got {eos.numel()}")
    for name, t in (("unfinished", unfinished), ("input_ids", input_ids), ("positions", positions),
                    ("limits", limits)):
        if t.shape != (rows,):
            raise ValueError(f"{name} must be ({rows},), got {tuple(t.shape)}")
    if ring.dim() != 2 or ring.shape[0] != rows or counters.shape != (2,):
        raise ValueError(f"ring must be ({rows}, R) and counters (2,), got {tuple(ring.shape)} and "
                         f"{tuple(counters.shape)}")


def advance_step(tokens: torch.Tensor, unfinished: torch.Tensor, eos: torch.Tensor, pad: torch.Tensor,
                 ring: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, limits: torch.Tensor,
                 counters: torch.Tensor) -> None:
    """:func:`greedy_step`'s state update for tokens chosen elsewhere: ``tokens (B,)`` int64 (e.g. sampled); the other
    arguments as there."""
    if tokens.shape != (tokens.shape[0],):
        raise ValueError(f"tokens must be (B,), got {tuple(tokens.shape)}")
    _check_state(tokens.shape[0], unfinished, eos, ring, input_ids, positions, limits, counters)
    call_op(_advance_step_op, tokens, unfinished, eos, pad, ring, input_ids, positions, limits, counters)


def greedy_step(logits: torch.Tensor, unfinished: torch.Tensor, eos: torch.Tensor, pad: torch.Tensor,
                ring: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, limits: torch.Tensor,
                counters: torch.Tensor) -> None:
    """Pick each row's greedy token and advance the decode loop's state in place (see the module docstring).

    Args:
        logits: ``(B, V)`` float, unit stride along V.
        unfinished: ``(B,)`` bool, updated.
        eos: ``(E,)`` int64 end-of-sequence ids, ``E`` a power of two, padded with -1.
        pad: ``(1,)`` int64, the token finished rows emit.
        ring: ``(B, R)`` int64, contiguous; step ``s`` writes column ``s % R``.
        input_ids, positions: ``(B,)`` int64, the next step's inputs, updated.
        limits: ``(B,)`` int64, the position at which each row stops computing (its position becomes -1 there).
        counters: ``(2,)`` int64 ``(step, n_tokens)``, updated.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (B, V) with unit stride along V, got {tuple(logits.shape)}")
    _check_state(logits.shape[0], unfinished, eos, ring, input_ids, positions, limits, counters)
    call_op(_greedy_step_op, logits, unfinished, eos, pad, ring, input_ids, positions, limits, counters)
