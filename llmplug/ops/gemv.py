"""Matrix-vector product for one-token decode: ``y = x @ W^T (+ b)`` with ``x: (1, K)``, ``W: (N, K)``.

At batch 1 a decode step is a stream of weight reads; cuBLAS picks small-N split-K kernels for the narrower
projections (q/k/v, o) that reach ~3.1 TB/s of an H200's ~4.25. This kernel gives every program a few whole rows
of ``W`` (no split-K, no reduction launch) and keeps several loads in flight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import INTERPRET, llmplug_op, maybe_wrap, next_pow2, round_rne, tl, triton, use_triton


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: ``F.linear``. ``x: (1, K)``, ``weight: (N, K)``, ``bias: (N,)`` -> ``(1, N)``."""
    return F.linear(x, weight, bias)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_mask = (k + cols) < K
            w = tl.load(w_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            xk = tl.load(x_ptr + k + cols, mask=k_mask, other=0.0)
            acc += w.to(tl.float32) * xk.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        if INTERPRETED:  # the interpreter's casts truncate; round as the GPU does
            y = round_rne(y, out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


# NOTE: (BLOCK_N, BLOCK_K, num_warps, num_stages) defaults; benchmarks/gemv_sweep.py measures the alternatives.
DEFAULT_CONFIG = (8, 512, 4, 4)


@llmplug_op("gemv")
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int, block_k: int,
             num_warps: int, num_stages: int) -> torch.Tensor:
    if not use_triton(x):
        return gemv_ref(x, weight, bias)
    assert x.shape[0] == 1 and x.is_contiguous() and weight.stride(1) == 1, "gemv needs x (1, K) and W (N, K)"
    n, k = weight.shape
    out = x.new_empty((1, n))
    block_k = min(block_k, next_pow2(k))
    maybe_wrap(_gemv_kernel)[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, INTERPRETED=INTERPRET, num_warps=num_warps, num_stages=num_stages)
    return out


@_gemv_op.register_fake
def _(x, weight, bias, block_n, block_k, num_warps, num_stages):
    return x.new_empty((x.shape[0], weight.shape[0]))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] = DEFAULT_CONFIG) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a single row.

    Args:
        x: ``(1, K)`` contiguous.
        weight: ``(N, K)`` with unit stride along K (row views of a fused weight are fine).
        bias: optional ``(N,)``.
        config: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``.

    Returns:
        ``(1, N)`` in ``x.dtype``.
    """
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x of shape (1, {weight.shape[1]}), got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x.dtype={x.dtype} does not match weight.dtype={weight.dtype}")
    return torch.ops.llmplug.gemv(x.contiguous(), weight, bias, *config)
