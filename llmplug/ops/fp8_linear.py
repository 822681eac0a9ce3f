"""FP8 linear with per-token activation scales: ``y = (xq * xs) @ (wq * ws)^T (+ bias)`` on FP8 tensor cores.

``x: (M, K)`` is quantized per row to float8_e4m3fn by one Triton kernel (``xs = max|x| / 448``), then
``torch._scaled_mm`` multiplies it with the e4m3 weight ``wq: (N, K)`` (per-row scales ``ws: (N,)``), both scales
applied in the GEMM epilogue. That doubles the tensor-core rate of bf16 and halves the weight bytes, which is what
prefill-heavy work wants; one-token decode reads the same fp8 weights through :mod:`llmplug.ops.w8_linear` (no
activation rounding there).
"""

from __future__ import annotations

import functools

import torch

from ._triton import call_op, llmplug_op, maybe_wrap, next_pow2, tl, triton, use_triton

FP8_MAX = 448.0


def quantize_rows_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: (M, K)`` -> ``(xq (M, K) float8_e4m3fn, xs (M, 1) float32)`` with ``x ~= xq * xs``."""
    xs = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return (x.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), xs


def fp8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: the quantized activations times the fp8 weights in fp32. ``(M, K)`` -> ``(M, N)``."""
    xq, xs = quantize_rows_fp8_ref(x)
    y = (xq.float() @ qweight.float().t()) * xs * scales
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if triton is not None:

    @triton.jit
    def _quantize_rows_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x_row, q_row = x_ptr + row.to(tl.int64) * stride_xm, q_ptr + row.to(tl.int64) * stride_qm
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, K, BLOCK):
            x = tl.load(x_row + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
        tl.store(s_ptr + row, scale)
        for k in range(0, K, BLOCK):
            x = tl.load(x_row + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
            tl.store(q_row + k + cols, q.to(q_ptr.dtype.element_ty), mask=k + cols < K)


@llmplug_op("quantize_rows_fp8")
def _quantize_rows_fp8_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return quantize_rows_fp8_ref(x)
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    maybe_wrap(_quantize_rows_fp8_kernel)[(m,)](x, xq, xs, k, x.stride(0), xq.stride(0),
                                                BLOCK=min(2048, next_pow2(k)), num_warps=4)
    return xq, xs


@_quantize_rows_fp8_op.register_fake
def _(x):
    return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device))


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic fp8 quantization of ``x: (M, K)`` (unit stride along K): ``(xq (M, K), xs (M, 1))``."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with unit stride along K, got shape {tuple(x.shape)} strides {x.stride()}")
    return call_op(_quantize_rows_fp8_op, x)


@functools.cache
def scaled_mm_supported(device: torch.device) -> bool:
    """True where ``torch._scaled_mm`` runs e4m3 with row-wise scales: CUDA compute capability 8.9 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (qweight * scales[:, None])^T (+ bias)`` with ``x`` rounded to fp8 per row.

    Args:
        x: ``(M, K)`` bfloat16 on CUDA (sm 8.9+) for the FP8 GEMM; anything else runs :func:`fp8_linear_ref`.
        qweight: ``(N, K)`` float8_e4m3fn, contiguous; K and N multiples of 16 for ``torch._scaled_mm``.
        scales: ``(N,)`` float32.
        bias: optional ``(N,)``.

    Returns:
        ``(M, N)`` in ``x.dtype``.
    """
    if not (x.dtype == torch.bfloat16 and scaled_mm_supported(x.device)):
        return fp8_linear_ref(x, qweight, scales, bias)
    xq, xs = quantize_rows_fp8(x if x.stride(1) == 1 else x.contiguous())
    return torch._scaled_mm(xq, qweight.t(), scale_a=xs, scale_b=scales.view(1, -1), bias=bias,
                            out_dtype=torch.bfloat16)
