"""Matrix-vector product for one-token decode: ``y = x @ W^T (+ b)`` with ``x: (1, K)``, ``W: (N, K)``.

Over a fused gate/up weight the MLP's gated activation can be applied in the epilogue (``gated``): a program owns
gate rows and their up rows, which saves the activation kernel and its round trip.

At batch 1 a decode step is a stream of weight reads; cuBLAS picks small-N split-K kernels for the narrower
projections (q/k/v, o) that reach ~3.1 TB/s of an H200's ~4.25. This kernel gives every program a few whole rows
of ``W`` (no split-K, no reduction launch) and keeps several loads in flight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._qmm import gemv_rows, store_rows
from ._triton import (
    INTERPRET,
    call_op,
    llmplug_op,
    maybe_wrap,
    next_pow2,
    pdl_options,
    tl,
    triton,
    use_triton,
    wait_inputs,
)
from .act_mul import ACTIVATIONS, act_and_mul_ref


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: str = "") -> torch.Tensor:
    """Reference. ``x: (1, K)``, ``weight: (N, K)`` -> ``(1, N)``, or ``(1, N / 2)`` ``act(gate) * up`` with
    ``gated``."""
    y = F.linear(x, weight, bias)
    return act_and_mul_ref(y, gated) if gated else y


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_wn, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        rows, row_mask = gemv_rows(pid, N, BLOCK_N, GATED)
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
        # the first weight tile is read before waiting for x (under PDL, while the previous kernel finishes)
        w = tl.load(w_ptrs, mask=row_mask[:, None] & (cols < K)[None, :], other=0.0)
        wait_inputs(PDL)
        acc = w.to(tl.float32) * tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        for k in range(BLOCK_K, K, BLOCK_K):
            k_mask = (k + cols) < K
            w = tl.load(w_ptrs + k, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            acc += w.to(tl.float32) * tl.load(x_ptr + k + cols, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        store_rows(out_ptr, tl.sum(acc, axis=1), pid, rows, row_mask, N, b_ptr, HAS_BIAS, GATED, BLOCK_N,
                   INTERPRETED)


def choose_config(n: int, k: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for ``W: (N, K)``.

    NOTE: H200, 2026-11-22, benchmarks/gemv_sweep.py, GB/s with cuBLAS in brackets. Wide outputs: 8B gate_up (16,
    256, 4, 4) 4329 [3921], lm_head 4563 [4422]. Wider-than-deep q/k/v: 8B (8, 512, 4, 4) 3576 [3108], 1B (8, 1024,
    8, 3) 2678 [1919]. Square and deep (o, down): (2, 1024, 4, 4), 8B o 3181 [2707], down 3966 [3822], 1B down 3266
    [2654].
    """
    if n >= 16384:
        return (16, 256, 4, 4)
    if k < n:
        return (8, 1024, 8, 3) if k <= 2048 else (8, 512, 4, 4)
    return (2, 1024, 4, 4)


@llmplug_op("gemv")
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: str, block_n: int,
             block_k: int, num_warps: int, num_stages: int) -> torch.Tensor:
    if not use_triton(x):
        return gemv_ref(x, weight, bias, gated)
    assert x.shape[0] == 1 and x.is_contiguous() and weight.stride(1) == 1, "gemv needs x (1, K) and W (N, K)"
    assert not gated or (weight.shape[0] % 2 == 0 and block_n % 2 == 0), "gated gemv layout"
    n, k = weight.shape
    out = x.new_empty((1, n // 2 if gated else n))
    maybe_wrap(_gemv_kernel)[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0), HAS_BIAS=bias is not None,
        GATED=gated, BLOCK_N=block_n, BLOCK_K=min(block_k, next_pow2(k)), INTERPRETED=INTERPRET,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(x))
    return out


@_gemv_op.register_fake
def _(x, weight, bias, gated, block_n, block_k, num_warps, num_stages):
    return x.new_empty((x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0]))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None, gated: str = "") -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a single row, optionally gated: ``act(gate) * up`` of a fused gate/up ``weight``.

    Args:
        x: ``(1, K)`` contiguous.
        weight: ``(N, K)`` with unit stride along K (row views of a fused weight are fine).
        bias: optional ``(N,)``.
        config: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``; default :func:`choose_config`.
        gated: ``""`` (none), ``"silu"`` or ``"gelu_tanh"``: ``weight`` holds gate rows then up rows and the result is
            ``act(y[:, :N/2]) * y[:, N/2:]``, bit for bit :func:`~llmplug.ops.act_mul.act_and_mul` of the product.

    Returns:
        ``(1, N)`` in ``x.dtype``; ``(1, N / 2)`` when gated.
    """
    n, k = weight.shape
    if gated and (gated not in ACTIVATIONS or n % 2):
        raise ValueError(f"gated={gated!r} needs one of {ACTIVATIONS} and an even number of rows (gate then up), "
                         f"got {n}")
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k:
        raise ValueError(f"gemv needs x of shape (1, {k}), got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x.dtype={x.dtype} does not match weight.dtype={weight.dtype}")
    config = config or choose_config(n, k)
    if gated and config[0] % 2:
        config = (2 * config[0], *config[1:])
    return call_op(_gemv_op, x.contiguous(), weight, bias, gated, *config)
