"""RMSNorm, plain and fused with the residual add, for Llama-style (``w``) and Gemma-style (``1 + w``) weights.

``rms_norm`` also normalises per head: ``x: (T, H, D)`` may be a strided view into a fused qkv projection (Qwen3 and
Gemma3 q/k norm). ``add_rms_norm`` replaces the decoder layer's ``residual + x`` followed by the next norm;
``parts_add_rms_norm`` does the same for an ``x`` left as fp32 partial products over K slices
(:mod:`~llmplug.ops.ksplit_gemm`), summing them first.
"""

from __future__ import annotations

import torch

from ._triton import (
    INTERPRET,
    call_op,
    llmplug_op,
    maybe_wrap,
    next_pow2,
    pdl_options,
    rounded,
    tl,
    triton,
    use_triton,
    wait_inputs,
)


def round_first_for(offset: float, round_first: bool | None) -> bool:
    """Whether the normalised value is rounded before the weight multiply: ``round_first``, or where None HF's
    Llama style for ``offset == 0`` and Gemma's for ``1 + w``."""
    return offset == 0.0 if round_first is None else bool(round_first)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                 round_first: bool | None = None) -> torch.Tensor:
    """Reference. ``x: (..., N)``, ``weight: (N,)`` -> contiguous ``x.shape`` in ``x.dtype``; math in fp32.

    Rounding follows HF: with ``round_first`` (Llama style) the normalised value is rounded to ``x.dtype`` before
    the weight multiply; without (Gemma's ``1 + w``, OLMo 2's ``w``) everything stays fp32 until the final cast.
    ``round_first=None``: Llama's where ``offset == 0``, Gemma's otherwise.
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if round_first_for(offset, round_first):
        normed = normed.to(x.dtype).float()
    return (normed * (offset + weight.float())).to(x.dtype).contiguous()


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
    round_first: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference. Returns ``(rms_norm(x + residual), x + residual)``; the sum is rounded to ``x.dtype`` first."""
    residual_out = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(residual_out, weight, eps, offset, round_first), residual_out


def parts_add_rms_norm_ref(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
    round_first: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference. ``parts: (S, R, N)`` fp32 summed in order and rounded to ``residual.dtype`` (a GEMM's output), then
    :func:`add_rms_norm_ref` with ``residual``."""
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return add_rms_norm_ref(total.to(residual.dtype), residual, weight, eps, offset, round_first)


if triton is not None:

    @triton.jit
    def rms_scale(x, rstd, w, DTYPE: tl.constexpr, ROUND_FIRST: tl.constexpr, INTERPRETED: tl.constexpr):
        """The RMSNorm output ``x * rstd * w`` (fp32 operands, broadcastable) rounded where HF's norm rounds: after
        the normalisation when ``ROUND_FIRST`` (Llama style), and the result, to ``DTYPE``; kept in fp32."""
        normed = x * rstd
        if ROUND_FIRST:  # HF's Llama-style RMSNorm rounds before the weight multiply
            normed = rounded(normed, DTYPE, INTERPRETED)
        return rounded(normed * w, DTYPE, INTERPRETED)

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, inner, N, stride_xo, stride_xi,
                         stride_part, stride_res, eps, offset, HAS_RESIDUAL: tl.constexpr, PARTS: tl.constexpr,
                         ROUND_FIRST: tl.constexpr, INTERPRETED: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
        # PARTS > 0: x holds that many fp32 summands, ``stride_part`` apart, summed in order and rounded to the
        # residual's dtype before the add
        wait_inputs(PDL)
        # Row r of the (n_rows, N) output is x[r // inner, r % inner, :]; a 2D x has inner == 1.
        # Inductor passes Python floats as fp64 (eager Triton as fp32): pin them, or the math turns fp64.
        eps = tl.cast(eps, tl.float32)
        offset = tl.cast(offset, tl.float32)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
        x_offs = ((rows // inner) * stride_xo + (rows % inner) * stride_xi)[:, None] + cols[None, :]
        out_offs = (rows * N)[:, None] + cols[None, :]
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        if PARTS > 0:
            for part in tl.static_range(1, PARTS):
                x += tl.load(x_ptr + part * stride_part + x_offs, mask=mask, other=0.0)
            x = rounded(x, res_out_ptr.dtype.element_ty, INTERPRETED)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + (rows * stride_res)[:, None] + cols[None, :], mask=mask, other=0.0)
            summed = (x + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + out_offs, summed, mask=mask)
            x = summed.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32) + offset
        dt = out_ptr.dtype.element_ty
        out = rms_scale(x, rstd[:, None], w[None, :], dt, ROUND_FIRST, INTERPRETED)
        tl.store(out_ptr + out_offs, out.to(dt), mask=mask)


def _launch_config(n: int) -> tuple[int, int, int]:
    """``(BLOCK, ROWS, num_warps)`` for rows of length ``n``: several rows per program when rows are short."""
    block = next_pow2(n)
    rows = max(1, 1024 // block)
    num_warps = min(32, max(1, rows * block // 512))
    return block, rows, num_warps


def _launch(x, weight, out, eps, offset, round_first, residual=None, residual_out=None, parts=None):
    """Normalise rows of ``x`` into ``out``; with ``residual``, add it first and store the sum in ``residual_out``;
    with ``parts`` (``(S, R, N)`` fp32, ``x`` its first), sum them into ``x`` first."""
    inner, stride_xi = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    n_rows, n = x.shape[0] * inner, x.shape[-1]
    num_parts, stride_part = (0, 0) if parts is None else (parts.shape[0], parts.stride(0))
    block, rows, num_warps = _launch_config(n)
    has_residual = residual is not None
    if not has_residual:  # unused pointers: any tensor will do
        residual, residual_out = x, out
    maybe_wrap(_rms_norm_kernel)[(triton.cdiv(n_rows, rows),)](
        x, residual, weight, out, residual_out, n_rows, inner, n, x.stride(0), stride_xi, stride_part,
        residual.stride(0), eps, offset, HAS_RESIDUAL=has_residual, PARTS=num_parts, ROUND_FIRST=round_first,
        INTERPRETED=INTERPRET, ROWS=rows, BLOCK=block, num_warps=num_warps, **pdl_options(x))


@llmplug_op("rms_norm")
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, round_first: bool) -> torch.Tensor:
    if not use_triton(x):
        return rms_norm_ref(x, weight, eps, offset, round_first)
    if x.dim() not in (2, 3):  # any other rank (a compiled model's (B, T, H, D) q/k): its rows, made contiguous
        return _rms_norm_op(x.reshape(-1, x.shape[-1]), weight, eps, offset, round_first).view(x.shape)
    assert x.stride(-1) == 1, "x must be (R, N) or (T, H, N) with unit stride on the last dim"
    assert weight.shape == x.shape[-1:] and weight.stride(0) == 1, "weight must be a contiguous (N,) vector"
    out = x.new_empty(x.shape)
    if out.numel() > 0:
        _launch(x, weight, out, eps, offset, round_first)
    return out


@_rms_norm_op.register_fake
def _(x, weight, eps, offset, round_first):
    return x.new_empty(x.shape)


@llmplug_op("add_rms_norm")
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, round_first: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return add_rms_norm_ref(x, residual, weight, eps, offset, round_first)
    if x.dim() != 2:  # a compiled model's (B, T, N): its rows
        n = x.shape[-1]
        out, total = _add_rms_norm_op(x.reshape(-1, n), residual.reshape(-1, n), weight, eps, offset, round_first)
        return out.view(x.shape), total.view(x.shape)
    assert x.stride(-1) == 1, "x must be (R, N) with unit stride on the last dim"
    assert residual.shape == x.shape and residual.stride(-1) == 1, "residual must be (R, N) like x"
    assert residual.dtype == x.dtype, "x and residual must share a dtype"
    assert weight.shape == x.shape[-1:] and weight.stride(0) == 1, "weight must be a contiguous (N,) vector"
    out = x.new_empty(x.shape)
    residual_out = x.new_empty(x.shape)
    if x.numel() > 0:
        _launch(x, weight, out, eps, offset, round_first, residual, residual_out)
    return out, residual_out


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset, round_first):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@llmplug_op("parts_add_rms_norm")
def _parts_add_rms_norm_op(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, round_first: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(parts):
        return parts_add_rms_norm_ref(parts, residual, weight, eps, offset, round_first)
    assert parts.stride(-1) == 1 and parts.stride(1) == parts.shape[2], "parts must be (S, R, N) with rows contiguous"
    assert residual.is_contiguous() and weight.stride(0) == 1, "residual (R, N) and weight (N,) must be contiguous"
    out = residual.new_empty(residual.shape)
    residual_out = residual.new_empty(residual.shape)
    if residual.numel() > 0:
        _launch(parts[0], weight, out, eps, offset, round_first, residual, residual_out, parts=parts)
    return out, residual_out


@_parts_add_rms_norm_op.register_fake
def _(parts, residual, weight, eps, offset, round_first):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight.shape={tuple(weight.shape)} does not match the last dim of x.shape={tuple(x.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             round_first: bool | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * (offset + weight)``, computed in fp32.

    Args:
        x: ``(R, N)`` rows, or ``(T, H, N)`` heads (e.g. a strided view into a fused qkv tensor); bf16/fp16/fp32,
            last dim contiguous.
        weight: ``(N,)``, any float dtype.
        eps: added to the mean square.
        offset: ``0.0`` for Llama-style ``w``, ``1.0`` for Gemma-style ``(1 + w)``.
        round_first: round the normalised value to ``x.dtype`` before the weight multiply (HF's Llama), or keep fp32
            to the end (Gemma, OLMo 2); None: :func:`round_first_for` ``offset``.

    Returns:
        A new contiguous tensor of ``x.shape`` in ``x.dtype``.
    """
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be (R, N) or (T, H, N); got x.shape={tuple(x.shape)}")
    _check_weight(x, weight)
    return call_op(_rms_norm_op, x, weight, float(eps), float(offset), round_first_for(offset, round_first))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
    round_first: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with RMSNorm: ``s = x + residual`` (rounded to ``x.dtype``), then ``rms_norm(s)``.

    Args:
        x: ``(R, N)`` bf16/fp16/fp32, last dim contiguous.
        residual: ``(R, N)``, same dtype as ``x``, last dim contiguous.
        weight: ``(N,)``, any float dtype.
        eps: added to the mean square.
        offset: ``0.0`` for Llama-style ``w``, ``1.0`` for Gemma-style ``(1 + w)``.
        round_first: as :func:`rms_norm`.

    Returns:
        ``(out, residual_out)``: new ``(R, N)`` tensors in ``x.dtype``; ``residual_out = x + residual`` and
        ``out = rms_norm(residual_out)``. The inputs are not modified.
    """
    if x.dim() != 2 or residual.shape != x.shape:
        raise ValueError(f"x and residual must both be (R, N); got {tuple(x.shape)} and {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"residual.dtype={residual.dtype} differs from x.dtype={x.dtype}")
    _check_weight(x, weight)
    return call_op(_add_rms_norm_op, x, residual, weight, float(eps), float(offset),
                   round_first_for(offset, round_first))


def parts_add_rms_norm(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
    round_first: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` of ``x = sum(parts)``, the summands of a GEMM's output left unsummed
    (:func:`~llmplug.ops.ksplit_gemm.ksplit_matmul`): summed in order in fp32 and rounded to ``residual``'s dtype,
    as the GEMM's own output would be, then added to ``residual`` and normalised; one kernel.

    Args:
        parts: ``(S, R, N)`` fp32, rows contiguous.
        residual: ``(R, N)`` contiguous; its dtype is the outputs'.
        weight, eps, offset, round_first: as :func:`add_rms_norm`.

    Returns:
        ``(out, residual_out)`` as :func:`add_rms_norm`'s, ``(R, N)`` in ``residual.dtype``.
    """
    if parts.dim() != 3 or parts.shape[1:] != residual.shape:
        raise ValueError(f"parts must be (S, R, N) over residual's (R, N); got {tuple(parts.shape)} and "
                         f"{tuple(residual.shape)}")
    if parts.dtype != torch.float32:
        raise ValueError(f"parts must be float32 summands, got {parts.dtype}")
    _check_weight(residual, weight)
    return call_op(_parts_add_rms_norm_op, parts, residual, weight, float(eps), float(offset),
                   round_first_for(offset, round_first))
