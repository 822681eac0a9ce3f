"""Matrix-vector product for one-token decode: ``y = x @ W^T (+ b)`` with ``x: (1, K)``, ``W: (N, K)``.

Over a fused gate/up weight the MLP's gated activation can be applied in the epilogue (``gated``): a program owns
gate rows and their up rows, which saves the activation kernel and its round trip. :func:`add_norm_gemv` puts the
decoder's residual add + RMSNorm in the prologue instead: every program sums the residual, finds the row's rsqrt of
the mean square itself (the vectors are a few KiB, read from L2/L1) and normalises each input chunk as it reads it;
program 0 writes the new residual. That saves the norm kernel (~1-3 us, twice a layer) and its round trip, where
the weight is small enough for the repeated normalisation not to cost more (:func:`norm_in_prologue`).

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
    rounded,
    tl,
    triton,
    use_triton,
    wait_inputs,
)
from .act_mul import act_and_mul_ref, check_gated
from .rms_norm import add_rms_norm_ref, rms_scale, round_first_for

NORM_BLOCK = 1024  # elements of x + residual the norm prologue reads at a time (more raises register use)


def norm_in_prologue(numel: int) -> bool:
    """Whether :func:`add_norm_gemv` beats the norm kernel + :func:`gemv` on a weight of ``numel`` elements.

    The prologue saves one launch (a fixed ~1-3 us), but every program re-derives the normalised input it reads, a
    cost that grows with the weight's size. NOTE: fused wins up to 2^26 elements (q/k/v, 1B gate/up), loses above
    (8B gate/up, lm_head): H200, 2026-11-22 (BENCHMARKS.md, "Norm in the GEMV's prologue").
    """
    return numel <= 1 << 26


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: str = "",
             fp32_out: bool = False) -> torch.Tensor:
    """Reference. ``x: (1, K)``, ``weight: (N, K)`` -> ``(1, N)``, or ``(1, N / 2)`` ``act(gate) * up`` with
    ``gated``; unrounded fp32 with ``fp32_out``."""
    if fp32_out:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    y = F.linear(x, weight, bias)
    return act_and_mul_ref(y, gated) if gated else y


def add_norm_gemv_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, offset: float,
                      weight: torch.Tensor, bias: torch.Tensor | None = None, gated: str = "",
                      round_first: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: :func:`~llmplug.ops.rms_norm.add_rms_norm_ref` then :func:`gemv_ref`. ``x, residual: (1, K)`` ->
    ``(y, x + residual)``."""
    normed, residual_out = add_rms_norm_ref(x, residual, norm_weight, eps, offset, round_first)
    return gemv_ref(normed, weight, bias, gated), residual_out


if triton is not None:

    @triton.jit
    def _add_norm_rstd(x_ptr, res_ptr, res_out_ptr, eps, K, pid, NORM_BLOCK: tl.constexpr, NORM_STEPS: tl.constexpr,
                       INTERPRETED: tl.constexpr):
        """``rsqrt(mean(s^2) + eps)`` of ``s = x + residual`` rounded to the input dtype (as ``add_rms_norm``), read
        ``NORM_BLOCK`` elements at a time; program 0 stores ``s`` as the new residual."""
        dt = x_ptr.dtype.element_ty
        cols = tl.arange(0, NORM_BLOCK)
        squares = tl.zeros([NORM_BLOCK], dtype=tl.float32)
        for step in tl.static_range(NORM_STEPS):  # unrolled: every load issued at once
            k = step * NORM_BLOCK
            mask = (k + cols) < K
            s = tl.load(x_ptr + k + cols, mask=mask, other=0.0).to(tl.float32)
            s = rounded(s + tl.load(res_ptr + k + cols, mask=mask, other=0.0).to(tl.float32), dt, INTERPRETED)
            tl.store(res_out_ptr + k + cols, s.to(dt), mask=(k + cols) < tl.where(pid == 0, K, 0))
            squares += s * s
        return tl.rsqrt(tl.sum(squares, axis=0) / K + tl.cast(eps, tl.float32))

    @triton.jit
    def _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, offset, k, cols, K, ADD_NORM: tl.constexpr,
                     ROUND_FIRST: tl.constexpr, INTERPRETED: tl.constexpr):
        """``x[k + cols]`` in fp32; with ``ADD_NORM`` the normalised ``x + residual`` rounded as ``add_rms_norm``
        rounds it (the sum, the normalised value when ``ROUND_FIRST``, the weighted result)."""
        dt = x_ptr.dtype.element_ty
        mask = (k + cols) < K
        x = tl.load(x_ptr + k + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD_NORM:
            s = rounded(x + tl.load(res_ptr + k + cols, mask=mask, other=0.0).to(tl.float32), dt, INTERPRETED)
            w = tl.load(nw_ptr + k + cols, mask=mask, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32)
            x = rms_scale(s, rstd, w, dt, ROUND_FIRST, INTERPRETED)
        return x

    @triton.jit
    def _stacked_rows(w_ptr, wb_ptr, wc_ptr, rows, N_A, N_AB, stride_wn):
        """Where each of ``rows`` starts when the weight is up to three tensors stacked: rows below ``N_A`` are the
        first's, below ``N_AB`` the second's (from its row 0), the rest the third's."""
        in_b, in_c = rows >= N_A, rows >= N_AB
        local = rows - tl.where(in_c, N_AB, tl.where(in_b, N_A, 0))
        return tl.where(in_c, wc_ptr, tl.where(in_b, wb_ptr, w_ptr)) + local.to(tl.int64) * stride_wn

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, wb_ptr, wc_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, res_out_ptr, eps, offset, N, N_A,
                     N_AB, K, stride_wn, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ADD_NORM: tl.constexpr,
                     ROUND_FIRST: tl.constexpr, STACKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NORM_BLOCK: tl.constexpr, NORM_STEPS: tl.constexpr, INTERPRETED: tl.constexpr,
                     PDL: tl.constexpr):
        pid = tl.program_id(0)
        rows, row_mask = gemv_rows(pid, N, BLOCK_N, GATED)
        cols = tl.arange(0, BLOCK_K)
        if STACKED:  # rows of up to three weights (N_A, N_AB): :func:`gemv_group`
            w_ptrs = _stacked_rows(w_ptr, wb_ptr, wc_ptr, rows, N_A, N_AB, stride_wn)[:, None] + cols[None, :]
        else:
            w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
        # the first weight tile is read before waiting for x (under PDL, while the previous kernel finishes)
        w = tl.load(w_ptrs, mask=row_mask[:, None] & (cols < K)[None, :], other=0.0)
        wait_inputs(PDL)
        rstd = 1.0
        if ADD_NORM:
            rstd = _add_norm_rstd(x_ptr, res_ptr, res_out_ptr, eps, K, pid, NORM_BLOCK, NORM_STEPS, INTERPRETED)
        x = _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, offset, 0, cols, K, ADD_NORM, ROUND_FIRST, INTERPRETED)
        acc = w.to(tl.float32) * x[None, :]
        for k in range(BLOCK_K, K, BLOCK_K):
            w = tl.load(w_ptrs + k, mask=row_mask[:, None] & ((k + cols) < K)[None, :], other=0.0)
            x = _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, offset, k, cols, K, ADD_NORM, ROUND_FIRST, INTERPRETED)
            acc += w.to(tl.float32) * x[None, :]
        store_rows(out_ptr, tl.sum(acc, axis=1), pid, rows, row_mask, N, b_ptr, HAS_BIAS, GATED, BLOCK_N,
                   INTERPRETED)


def choose_config(n: int, k: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for ``W: (N, K)``.

    NOTE: these beat cuBLAS on every 8B and 1B projection (H200, 2026-11-22), nearly square counting as square since
    an H100 TP sweep (2026-11-27; BENCHMARKS.md, "Figures moved from code comments").
    """
    if n >= 16384:
        return (16, 256, 4, 4)
    if 4 * n >= 5 * k:  # wider than deep by a quarter or more
        return (8, 1024, 8, 3) if k <= 2048 else (8, 512, 4, 4)
    return (2, 1024, 4, 4)


@llmplug_op("gemv")
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: str, block_n: int,
             block_k: int, num_warps: int, num_stages: int, fp32_out: bool) -> torch.Tensor:
    if not use_triton(x):
        return gemv_ref(x, weight, bias, gated, fp32_out)
    assert x.shape[0] == 1 and x.is_contiguous() and weight.stride(1) == 1, "gemv needs x (1, K) and W (N, K)"
    assert not gated or (weight.shape[0] % 2 == 0 and block_n % 2 == 0), "gated gemv layout"
    return _launch(x, weight, bias, gated, (block_n, block_k, num_warps, num_stages), fp32_out=fp32_out)


def _launch(x, weight, bias, gated, config, norm=None, fp32_out=False, stacked=()):
    """Launch the GEMV; ``norm = (residual, norm_weight, eps, offset, round_first, residual_out)`` adds the norm
    prologue; ``fp32_out``: the unrounded fp32 product; ``stacked``: one or two more weights whose rows follow
    ``weight``'s (same K and row stride)."""
    block_n, block_k, num_warps, num_stages = config
    weights = (weight, *stacked)
    k = weight.shape[1]
    n_a = weight.shape[0]
    n_ab = n_a + (stacked[0].shape[0] if stacked else 0)
    n = sum(w.shape[0] for w in weights)
    out = x.new_empty((1, n // 2 if gated else n), dtype=torch.float32 if fp32_out else x.dtype)
    residual, norm_weight, eps, offset, round_first, residual_out = norm or (x, x, 0.0, 0.0, True, x)
    norm_block = min(NORM_BLOCK, next_pow2(k))
    maybe_wrap(_gemv_kernel)[(triton.cdiv(n, block_n),)](
        x, weight, weights[min(1, len(stacked))], weights[len(stacked)], bias if bias is not None else weight, out,
        residual, norm_weight, residual_out, eps, offset, n, n_a, n_ab, k, weight.stride(0), HAS_BIAS=bias is not None,
        GATED=gated, ADD_NORM=norm is not None, ROUND_FIRST=round_first, STACKED=bool(stacked), BLOCK_N=block_n,
        BLOCK_K=min(block_k, next_pow2(k)),
        NORM_BLOCK=norm_block, NORM_STEPS=triton.cdiv(k, norm_block), INTERPRETED=INTERPRET, num_warps=num_warps,
        num_stages=num_stages, **pdl_options(x))
    return out


@_gemv_op.register_fake
def _(x, weight, bias, gated, block_n, block_k, num_warps, num_stages, fp32_out):
    return x.new_empty((x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0]),
                       dtype=torch.float32 if fp32_out else x.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None, gated: str = "", fp32_out: bool = False) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a single row, optionally gated: ``act(gate) * up`` of a fused gate/up ``weight``.

    Args:
        x: ``(1, K)`` contiguous.
        weight: ``(N, K)`` with unit stride along K (row views of a fused weight are fine).
        bias: optional ``(N,)``.
        config: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``; default :func:`choose_config`.
        gated: ``""`` (none), ``"silu"`` or ``"gelu_tanh"``: ``weight`` holds gate rows then up rows and the result is
            ``act(y[:, :N/2]) * y[:, N/2:]``, bit for bit :func:`~llmplug.ops.act_mul.act_and_mul` of the product.
        fp32_out: the product (and bias) in fp32, unrounded (not with ``gated``): a row-parallel rank's share, to be
            summed with the other ranks' before one rounding.

    Returns:
        ``(1, N)`` in ``x.dtype`` (fp32 with ``fp32_out``); ``(1, N / 2)`` when gated.
    """
    if fp32_out and gated:
        raise ValueError("gemv: fp32_out=True is for plain products, not gated ones")
    return call_op(_gemv_op, x.contiguous(), weight, bias, gated, *_checked_config(x, weight, config, gated),
                   fp32_out)


def _checked_config(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] | None,
                    gated: str, n: int | None = None) -> tuple[int, int, int, int]:
    """Validate :func:`gemv`'s arguments; the launch config (an even row count a program when gated). ``n``: the
    rows of the stacked weights (:func:`gemv_group`), else ``weight``'s."""
    n, k = n or weight.shape[0], weight.shape[1]
    check_gated(gated, n)
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k:
        raise ValueError(f"gemv needs x of shape (1, {k}), got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x.dtype={x.dtype} does not match weight.dtype={weight.dtype}")
    config = config or choose_config(n, k)
    if gated and config[0] % 2:
        config = (2 * config[0], *config[1:])
    return config


@llmplug_op("add_norm_gemv")
def _add_norm_gemv_op(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, offset: float,
                      round_first: bool, weight: torch.Tensor, bias: torch.Tensor | None, gated: str, block_n: int,
                      block_k: int, num_warps: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return add_norm_gemv_ref(x, residual, norm_weight, eps, offset, weight, bias, gated, round_first)
    assert x.is_contiguous() and residual.is_contiguous() and norm_weight.is_contiguous(), "add_norm_gemv layout"
    residual_out = x.new_empty(x.shape)
    norm = (residual, norm_weight, eps, offset, round_first, residual_out)
    return _launch(x, weight, bias, gated, (block_n, block_k, num_warps, num_stages), norm), residual_out


@_add_norm_gemv_op.register_fake
def _(x, residual, norm_weight, eps, offset, round_first, weight, bias, gated, block_n, block_k, num_warps,
      num_stages):
    return x.new_empty((1, weight.shape[0] // 2 if gated else weight.shape[0])), x.new_empty(x.shape)


def add_norm_gemv(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, offset: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None, gated: str = "",
                  round_first: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~llmplug.ops.rms_norm.add_rms_norm` fused into the next :func:`gemv`'s prologue.

    Args:
        x, residual: ``(1, K)`` of one dtype.
        norm_weight: ``(K,)``; eps, offset, round_first: as :func:`~llmplug.ops.rms_norm.add_rms_norm`.
        weight, bias, config, gated: as :func:`gemv`.

    Returns:
        ``(y, x + residual)``: ``y`` is ``gemv(add_rms_norm(x, residual, ...)[0], weight, bias, gated=gated)`` (the
        normalised input rounded as ``add_rms_norm`` rounds it; its mean square may differ in the last bit, being
        summed in another order), ``x + residual`` rounded to ``x.dtype``.
    """
    k = weight.shape[1]
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual ({tuple(residual.shape)}, {residual.dtype}) must match x ({tuple(x.shape)}, "
                         f"{x.dtype})")
    if norm_weight.shape != (k,):
        raise ValueError(f"norm_weight.shape={tuple(norm_weight.shape)} must be ({k},)")
    config = _checked_config(x, weight, config, gated)
    return call_op(_add_norm_gemv_op, x.contiguous(), residual.contiguous(), norm_weight.contiguous(), float(eps),
                   float(offset), round_first_for(offset, round_first), weight, bias, gated, *config)


def gemv_group_ref(x: torch.Tensor, weights: list[torch.Tensor], gated: str = "",
                   norm: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`gemv_group`: ``(y, x + residual)``, the second an empty tensor without ``norm``."""
    residual_out = x.new_empty(0)
    if norm is not None:
        x, residual_out = add_rms_norm_ref(x, *norm)
    y = torch.cat([F.linear(x, w) for w in weights], dim=-1)
    return (act_and_mul_ref(y, gated) if gated else y), residual_out


@llmplug_op("gemv_group")
def _gemv_group_op(x: torch.Tensor, weights: list[torch.Tensor], residual: torch.Tensor | None,
                   norm_weight: torch.Tensor | None, eps: float, offset: float, round_first: bool, gated: str,
                   block_n: int, block_k: int, num_warps: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    norm = None if residual is None else (residual, norm_weight, eps, offset, round_first)
    if not use_triton(x):
        return gemv_group_ref(x, weights, gated, norm)
    x = x.contiguous()  # a compiled graph's views arrive as they are
    residual_out = x.new_empty(x.shape if norm else 0)
    if norm:
        norm = (norm[0].contiguous(), norm[1].contiguous(), *norm[2:], residual_out)  # _launch's order
    config = (block_n, block_k, num_warps, num_stages)
    y = _launch(x, weights[0], None, gated, config, norm, stacked=tuple(weights[1:]))
    return y, residual_out


@_gemv_group_op.register_fake
def _(x, weights, residual, norm_weight, eps, offset, round_first, gated, block_n, block_k, num_warps, num_stages):
    n = sum(w.shape[0] for w in weights)
    return x.new_empty((1, n // 2 if gated else n)), x.new_empty(x.shape if residual is not None else 0)


def gemv_group(x: torch.Tensor, weights: list[torch.Tensor], norm: tuple | None = None,
               config: tuple[int, int, int, int] | None = None, gated: str = ""):
    """One GEMV over two or three weights that share the input (q/k/v, gate/up) without concatenating them: their
    rows are read where they lie, as if stacked, in one launch.

    Args:
        x: ``(1, K)``.
        weights: two or three ``(N_i, K)`` of ``x``'s dtype, unit stride along K and one row stride.
        norm: ``(residual, norm_weight, eps, offset, round_first)``: :func:`add_norm_gemv`'s prologue (``x +
            residual`` normalised as :func:`~llmplug.ops.rms_norm.add_rms_norm` does) before the product.
        config: as :func:`gemv`, for the stacked ``(sum N_i, K)``.
        gated: ``"silu"`` / ``"gelu_tanh"`` with two weights (gate, up) of one shape: ``act(x @ gate^T) * (x @ up^T)``.

    Returns:
        ``(1, sum N_i)`` (``(1, N_0)`` gated): the products side by side; with ``norm`` also ``x + residual``.
    """
    if not 2 <= len(weights) <= 3:
        raise ValueError(f"gemv_group takes two or three weights, got {len(weights)}")
    first = weights[0]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.stride() != first.stride():
            raise ValueError(f"gemv_group's weights must share K, dtype and strides: {tuple(first.shape)} "
                             f"{first.dtype} {first.stride()} against {tuple(w.shape)} {w.dtype} {w.stride()}")
    if gated and (len(weights) != 2 or weights[1].shape != first.shape):
        raise ValueError(f"gated={gated!r} needs two weights of one shape (gate, up), got "
                         f"{[tuple(w.shape) for w in weights]}")
    config = _checked_config(x, first, config, gated, n=sum(w.shape[0] for w in weights))
    residual, norm_weight, eps, offset, round_first = norm or (None, None, 0.0, 0.0, None)
    if norm is not None and (residual.shape != x.shape or residual.dtype != x.dtype or
                             norm_weight.shape != (first.shape[1],)):
        raise ValueError(f"norm: residual ({tuple(residual.shape)}, {residual.dtype}) must match x "
                         f"({tuple(x.shape)}, {x.dtype}) and norm_weight {tuple(norm_weight.shape)} be "
                         f"({first.shape[1]},)")
    y, residual_out = call_op(_gemv_group_op, x.contiguous(), list(weights), residual, norm_weight, float(eps),
                              float(offset), round_first_for(offset, round_first), gated, *config)
    return (y, residual_out) if norm is not None else y
