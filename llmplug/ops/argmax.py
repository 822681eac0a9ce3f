"""Each row's argmax of a logits matrix: the greedy token, in two short kernels.

``logits (B, V)`` -> ``(B,)`` int64, the first index of each row's maximum (as ``torch.argmax``), NaN counting as
+inf. The vocabulary is split into ``S`` blocks: ``B x S`` programs each find their block's maximum and its first
index (:func:`argmax_parts`), and one program a row picks the best of its ``S`` (the lowest index among equal maxima:
block ``p`` covers lower columns than block ``p + 1``). :mod:`llmplug.ops.greedy_step` shares the first kernel.
NOTE: ``torch.argmax`` read (128, 128256) bf16 logits at ~0.9 TB/s on an H100 (37 us a call, 1B workload (b);
BENCHMARKS.md, "The greedy argmax").
"""

from __future__ import annotations

import torch

from ._triton import call_op, llmplug_op, maybe_wrap, next_pow2, pdl_options, tl, triton, use_triton, wait_inputs


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """Reference: ``(B, V)`` -> ``(B,)`` int64, NaN counting as +inf, ties to the first index."""
    inf = float("inf")
    return logits.float().nan_to_num(nan=inf, posinf=inf, neginf=-inf).argmax(-1)


def argmax_block(vocab: int) -> int:
    """Columns a program of :func:`argmax_parts` covers: 2048 whatever the row count, so one compiled variant a
    vocabulary (a second, compiled mid-run, stalled a serving run)."""
    # NOTE: H100, 128,256 columns bf16, 1-256 rows: 2048 the fastest or tied of 1024-16384 (BENCHMARKS.md, "The greedy
    # argmax")
    return min(next_pow2(vocab), 2048)


if triton is not None:

    @triton.jit
    def _argmax_partial_kernel(logits_ptr, vals_ptr, idx_ptr, V, stride_l, S, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_inputs(PDL)
        row = tl.program_id(0)
        part = tl.program_id(1)
        cols = part * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + cols, mask=cols < V, other=float("-inf"))
        x = x.to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        best = tl.max(x, axis=0)
        # 2**31 - 1: past any column, never the first of the maxima (masked columns come last)
        first = tl.min(tl.where(x == best, cols, 2147483647), axis=0)
        tl.store(vals_ptr + row * S + part, best)
        tl.store(idx_ptr + row * S + part, first)

    @triton.jit
    def _argmax_combine_kernel(vals_ptr, idx_ptr, out_ptr, S, BLOCK_S: tl.constexpr):
        row = tl.program_id(0)
        parts = tl.arange(0, BLOCK_S)
        vals = tl.load(vals_ptr + row * S + parts, mask=parts < S, other=float("-inf"))
        idx = tl.load(idx_ptr + row * S + parts, mask=parts < S, other=2147483647)
        best = tl.max(vals, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(vals == best, idx, 2147483647), axis=0).to(tl.int64))


def argmax_parts(logits: torch.Tensor, pdl: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The first kernel on a CUDA ``logits (B, V)`` (unit stride along V): ``(vals, idx)``, both ``(B, S)``, each
    block's maximum (fp32) and its first column (int32)."""
    rows, vocab = logits.shape
    block = argmax_block(vocab)
    parts = triton.cdiv(vocab, block)
    vals = torch.empty((rows, parts), dtype=torch.float32, device=logits.device)
    idx = torch.empty((rows, parts), dtype=torch.int32, device=logits.device)
    maybe_wrap(_argmax_partial_kernel)[(rows, parts)](logits, vals, idx, vocab, logits.stride(0), parts, BLOCK=block,
                                                      num_warps=4, **pdl)
    return vals, idx


@llmplug_op("argmax")
def _argmax_op(logits: torch.Tensor) -> torch.Tensor:
    if not use_triton(logits):
        return argmax_ref(logits)
    vals, idx = argmax_parts(logits, pdl_options(logits))
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    maybe_wrap(_argmax_combine_kernel)[(logits.shape[0],)](vals, idx, out, vals.shape[1],
                                                            BLOCK_S=next_pow2(vals.shape[1]), num_warps=1)
    return out


@_argmax_op.register_fake
def _(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: ``logits (B, V)`` float with unit stride along V -> ``(B,)`` int64, the first index of
    the row's maximum (NaN counts as +inf)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (B, V) with unit stride along V, got shape {tuple(logits.shape)} and "
                         f"strides {logits.stride()}")
    return call_op(_argmax_op, logits)
