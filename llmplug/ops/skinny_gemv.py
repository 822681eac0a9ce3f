"""``y = x @ W^T (+ b)`` for a few rows (``2 <= M <= MAX_ROWS``): a speculative verify step's linears at batch 1,
decode at batch 2-8.

Each program reads ``BLOCK_N`` whole rows of ``W`` once and multiplies them on the tensor cores with all ``M`` input
rows, padded to 16 (the MMA's short side): the weight read stays the step's whole cost. cuBLAS's kernels at these
``M`` read the weight slower (an 8B step of 2-5 tokens at batch 1 took 1.17x a one-token step). A gated product runs
:func:`~llmplug.ops.act_mul.act_and_mul` after it (``M`` rows: a few KiB).
"""

from __future__ import annotations

import torch

from ._triton import (
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
from .act_mul import act_and_mul, check_gated
from .gemv import gemv_ref

MAX_ROWS = 8  # most rows this op takes; the decoder sends 2..MAX_ROWS-row CUDA inputs here


def skinny_gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    gated: str = "", fp32_out: bool = False) -> torch.Tensor:
    """Reference. ``x: (M, K)``, ``weight: (N, K)`` -> ``(M, N)``, or ``(M, N / 2)`` ``act(gate) * up`` with
    ``gated``; unrounded fp32 with ``fp32_out``: :func:`~llmplug.ops.gemv.gemv_ref`, which holds for any row count."""
    return gemv_ref(x, weight, bias, gated, fp32_out)


if triton is not None:

    @triton.jit
    def _skinny_gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_wn, stride_xm, stride_om,
                            HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr):
        # the weight rows are the MMA's long side, the few input rows (padded to M_PAD) its short one
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        cols = tl.arange(0, BLOCK_K)
        ms = tl.arange(0, M_PAD)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
        x_ptrs = x_ptr + ms[None, :] * stride_xm + cols[:, None]
        wait_inputs(PDL)
        acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_mask = (k + cols) < K
            w = tl.load(w_ptrs + k, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            xt = tl.load(x_ptrs + k, mask=k_mask[:, None] & (ms < M)[None, :], other=0.0)
            acc = tl.dot(w, xt, acc, input_precision=DOT_PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        o_ptrs = out_ptr + ms[None, :] * stride_om + rows[:, None]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (ms < M)[None, :])


@llmplug_op("skinny_gemv")
def _skinny_gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int, block_k: int,
                    num_warps: int, num_stages: int, fp32_out: bool) -> torch.Tensor:
    if not use_triton(x):
        return skinny_gemv_ref(x, weight, bias, fp32_out=fp32_out)
    m, k = x.shape
    n = weight.shape[0]
    out = x.new_empty((m, n), dtype=torch.float32 if fp32_out else x.dtype)
    maybe_wrap(_skinny_gemv_kernel)[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, weight.stride(0), x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, M_PAD=max(16, next_pow2(m)), BLOCK_N=block_n, BLOCK_K=min(block_k, next_pow2(k)),
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
        **pdl_options(x))
    return out


@_skinny_gemv_op.register_fake
def _(x, weight, bias, block_n, block_k, num_warps, num_stages, fp32_out):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32 if fp32_out else x.dtype)


SHARED_BUDGET = 200 * 1024  # bytes of shared memory the pipeline stages may take (an H100 SM has 227 KB)


def choose_config(n: int, k: int, element_size: int = 2) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for ``W: (N, K)`` of ``element_size``-byte elements; wider
    elements get fewer stages, as many as fit ``SHARED_BUDGET`` (fp32's four would need 240 KB). NOTE: the sweep's
    best on 6 of 15 8B shape/row cases (H100, 2026-11-27; BENCHMARKS.md, "Speculative decoding in `generate`")."""
    del n
    block_n, block_k = 64, min(256, next_pow2(k))  # the launch clamps BLOCK_K to K's power of two alike
    per_stage = (block_n + 16) * block_k * element_size  # a weight tile and the padded input rows
    return (block_n, block_k, 4, max(1, min(4, SHARED_BUDGET // per_stage)))


def skinny_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: str = "",
                config: tuple[int, int, int, int] | None = None, fp32_out: bool = False) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``2 <= M <= MAX_ROWS`` rows, optionally gated (as :func:`~llmplug.ops.gemv.gemv`).

    Args:
        x: ``(M, K)`` contiguous.
        weight: ``(N, K)`` with unit stride along K.
        bias: optional ``(N,)``.
        gated: ``""``, ``"silu"`` or ``"gelu_tanh"`` over a fused gate/up ``weight`` (gate rows first).
        config: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``; default :func:`choose_config`.
        fp32_out: the product (and bias) in fp32, unrounded (not with ``gated``), as :func:`~llmplug.ops.gemv.gemv`.

    Returns:
        ``(M, N)`` in ``x.dtype`` (fp32 with ``fp32_out``); ``(M, N / 2)`` when gated.
    """
    n, k = weight.shape
    check_gated(gated, n)
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != k:
        raise ValueError(f"skinny_gemv needs x of shape (M, {k}) with 1 <= M <= {MAX_ROWS}, got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x.dtype={x.dtype} does not match weight.dtype={weight.dtype}")
    if fp32_out and gated:
        raise ValueError("skinny_gemv: fp32_out=True is for plain products, not gated ones")
    y = call_op(_skinny_gemv_op, x.contiguous(), weight, bias,
                *(config or choose_config(n, k, weight.element_size())), fp32_out)
    return act_and_mul(y, gated) if gated else y
