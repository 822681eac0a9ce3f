"""``y = epilogue(prologue(x) @ W^T)`` for a decode step's 9-256 rows: the RMSNorm before a projection folded into its
prologue and epilogue, a gated activation or the residual add in its epilogue, K split over programs with an ordered
in-kernel fix-up.

At these row counts cuBLAS runs the narrow projections (q/k/v, o, down of a 1B) on a few dozen tiles and reads their
weights at 34-55% of the memory's rate (BENCHMARKS.md, "Second session of 2026-12-02"); the norm, the activation and
the residual add between them are separate kernels of ~2-3 us each. Here:

* ``norm_weight`` given: ``x`` is the residual stream; each program multiplies its ``x`` tile by the norm weight
  before the MMA and sums ``x^2`` over its K range; the epilogue scales by ``rsqrt(mean(x^2) + eps)``.
* ``gated``: ``W`` is a fused gate/up weight (gate rows first); a program holds a gate tile and its up tile and
  writes ``act(gate) * up``.
* ``residual`` given: the epilogue adds it (the decoder's ``residual + o_proj(...)``).
* ``splits > 1``: program ``(n, s)`` takes the ``s``-th of ``splits`` K ranges and writes fp32 partials; the last
  program of tile ``n`` to finish (a counter it resets) sums the partials in split order and runs the epilogue, so
  the result does not depend on which program finished last.
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
from .act_mul import act_and_mul_ref, check_gated, gated_act

MIN_ROWS, MAX_ROWS = 9, 256  # the row counts the decoder sends here
COUNTERS = 8192  # tiles a call may split (each has a counter)
_counters: dict[torch.device, torch.Tensor] = {}


def fused_gemm_ref(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                   residual: torch.Tensor | None = None, gated: str = "") -> torch.Tensor:
    """Reference. ``x: (M, K)``, ``weight: (N, K)``, ``norm_weight: (K,)``, ``residual: (M, N)`` -> ``(M, N)``, or
    ``(M, N / 2)`` with ``gated``; math in fp32, rounded as the kernel rounds: ``x * norm_weight`` to the dtype before
    the product, the scaled product before the activation or the residual add."""
    xf = x.float()
    if norm_weight is not None:
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xf = (xf * norm_weight.float()).to(x.dtype).float()
    y = xf @ weight.float().t()
    if norm_weight is not None:
        y = y * rstd
    y = y.to(x.dtype)
    if gated:
        return act_and_mul_ref(y, gated)
    if residual is not None:
        y = (y.float() + residual.float()).to(x.dtype)
    return y


if triton is not None:

    @triton.jit
    def _fused_gemm_kernel(x_ptr, w_ptr, g_ptr, res_ptr, out_ptr, part_ptr, sq_ptr, count_ptr, M, N, K, stride_xm,
                           stride_wn, stride_rm, stride_om, eps, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                           GATED: tl.constexpr, ACT: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                           INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        # program (tile, split): output columns tile * BLOCK_N.. (of each half when GATED), K range split of SPLITS
        tile = tl.program_id(0)
        split = tl.program_id(1)
        eps = tl.cast(eps, tl.float32)
        n_out = N // 2 if GATED else N
        rows = tl.arange(0, BLOCK_M)
        row_mask = rows < M
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_out
        ks = tl.arange(0, BLOCK_K)
        k_len = tl.cdiv(tl.cdiv(K, SPLITS), BLOCK_K) * BLOCK_K
        k_start = split * k_len
        k_end = tl.minimum(k_start + k_len, K)
        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
        w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
        wait_inputs(PDL)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            k_mask = (k + ks) < K
            x = tl.load(x_ptrs + k, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            if NORM:
                xf = x.to(tl.float32)
                sq += tl.sum(xf * xf, axis=1)
                g = tl.load(g_ptr + k + ks, mask=k_mask, other=0.0).to(tl.float32)
                x = (xf * g[None, :]).to(x_ptr.dtype.element_ty)
            w = tl.load(w_ptrs + k, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            if GATED:
                wu = tl.load(w_ptrs + n_out * stride_wn + k, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
                acc_up = tl.dot(x, tl.trans(wu), acc_up)
        last = True
        if SPLITS > 1:
            n_tiles = tl.num_programs(0)
            tile_offs = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            part = part_ptr + (split * n_tiles + tile).to(tl.int64) * (2 * BLOCK_M * BLOCK_N)
            tl.store(part + tile_offs, acc)
            if GATED:
                tl.store(part + BLOCK_M * BLOCK_N + tile_offs, acc_up)
            if NORM:
                tl.store(sq_ptr + (split * n_tiles + tile) * BLOCK_M + rows, sq)
            done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            last = done == SPLITS - 1
            if last:  # every split's partial is visible: sum them in split order
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    p = part_ptr + (s * n_tiles + tile).to(tl.int64) * (2 * BLOCK_M * BLOCK_N)
                    acc += tl.load(p + tile_offs, cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(p + BLOCK_M * BLOCK_N + tile_offs, cache_modifier=".cg")
                    if NORM:
                        sq += tl.load(sq_ptr + (s * n_tiles + tile) * BLOCK_M + rows, cache_modifier=".cg")
                tl.store(count_ptr + tile, 0)  # ready for the next call
        if last:
            dt = out_ptr.dtype.element_ty
            if NORM:
                rstd = tl.rsqrt(sq / K + eps)
                acc = acc * rstd[:, None]
                acc_up = acc_up * rstd[:, None]
            y = rounded(acc, dt, INTERPRETED)
            if GATED:
                y = gated_act(y, rounded(acc_up, dt, INTERPRETED), ACT, dt, INTERPRETED)
            if RESIDUAL:
                res = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :],
                              mask=row_mask[:, None] & col_mask[None, :], other=0.0)
                y = y + res.to(tl.float32)
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y.to(dt),
                     mask=row_mask[:, None] & col_mask[None, :])


def counters(device: torch.device) -> torch.Tensor:
    """The split-K fix-up's per-tile counters on ``device`` (zero between calls; each call's last programs reset
    theirs). Made on first use, which must come before any CUDA-graph capture that uses them."""
    device = torch.device(device)
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused_gemm's counters must be made before CUDA-graph capture: call "
                               "fused_gemm.counters(device) first")
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


@llmplug_op("fused_gemm")
def _fused_gemm_op(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                   residual: torch.Tensor | None, gated: str, block_n: int, block_k: int, splits: int, num_warps: int,
                   num_stages: int) -> torch.Tensor:
    if not use_triton(x):
        return fused_gemm_ref(x, weight, norm_weight, eps, residual, gated)
    m, k = x.shape
    n = weight.shape[0]
    n_out = n // 2 if gated else n
    out = x.new_empty((m, n_out))
    block_m = max(16, next_pow2(m))
    tiles = triton.cdiv(n_out, block_n)
    count = counters(x.device)
    if splits > 1:
        part = torch.empty(splits * tiles * 2 * block_m * block_n, dtype=torch.float32, device=x.device)
        sq = torch.empty(splits * tiles * block_m, dtype=torch.float32, device=x.device)
    else:
        part = sq = out
    maybe_wrap(_fused_gemm_kernel)[(tiles, splits)](
        x, weight, norm_weight if norm_weight is not None else weight, residual if residual is not None else out,
        out, part, sq, count, m, n, k, x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        NORM=norm_weight is not None, RESIDUAL=residual is not None, GATED=bool(gated), ACT=gated or "silu",
        SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=num_stages,
        INTERPRETED=INTERPRET, num_warps=num_warps, **pdl_options(x))
    return out


@_fused_gemm_op.register_fake
def _(x, weight, norm_weight, eps, residual, gated, block_n, block_k, splits, num_warps, num_stages):
    n = weight.shape[0]
    return x.new_empty((x.shape[0], n // 2 if gated else n))


def fused_gemm(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               residual: torch.Tensor | None = None, gated: str = "",
               config: tuple[int, int, int, int, int] = (64, 128, 1, 4, 3)) -> torch.Tensor:
    """``epilogue(prologue(x) @ weight.T)`` (see the module docstring).

    Args:
        x: ``(M, K)``, last dim contiguous; with ``norm_weight``, the un-normalised residual stream.
        weight: ``(N, K)``, unit stride along K, ``x``'s dtype.
        norm_weight: ``(K,)`` Llama-style RMSNorm weight, or None for a plain product.
        eps: the norm's epsilon.
        residual: ``(M, N)`` added to the product (not with ``gated``).
        gated: ``""``, ``"silu"`` or ``"gelu_tanh"`` over a fused gate/up ``weight`` (gate rows first).
        config: ``(BLOCK_N, BLOCK_K, splits, num_warps, num_stages)``.

    Returns:
        ``(M, N)`` in ``x.dtype``; ``(M, N / 2)`` when gated.
    """
    n, k = weight.shape
    check_gated(gated, n)
    if x.dim() != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"fused_gemm needs x of shape (M, {k}) with 1 <= M <= {MAX_ROWS}, got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x.dtype={x.dtype} does not match weight.dtype={weight.dtype}")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight.shape={tuple(norm_weight.shape)}; expected ({k},)")
    if residual is not None and (gated or residual.shape != (x.shape[0], n)):
        raise ValueError(f"residual must be ({x.shape[0]}, {n}) and not with gated; got "
                         f"{tuple(residual.shape)}, gated={gated!r}")
    block_n, block_k, splits, num_warps, num_stages = config
    return call_op(_fused_gemm_op, x, weight, norm_weight, float(eps), residual, gated, block_n, block_k, splits,
                   num_warps, num_stages)
