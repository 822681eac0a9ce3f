"""Weight-only 4-bit linear with group-wise scales and zero points, two values a byte.

``y = x @ W^T (+ bias)`` with ``W[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G]``; layout in
:mod:`llmplug.quant.formats` (``qweight (N, K // 2) uint8``, each group's first half in the low nibbles, its second
half in the high nibbles). No dequantised copy of the model is kept:

* the GEMV (one token) reads the weights as int32 words and loads the next step's weights before doing this step's
  math (two steps of loads in flight). With bf16 activations on sm_90+ it multiplies in packed bf16 pairs
  (:func:`word_dot_bf16`, about two instructions a weight); otherwise it decodes each nibble to ``128 + q`` in
  float32 with one shift and one bitwise op (:func:`nibble_f32`) and sums ``s * (sum((128 + q) * x) - (128 + z) *
  sum(x))`` per group, so the zero point and the offset cost one multiply per word. For a fused gate/up weight it
  applies the activation in its epilogue (``gated``);
* the GEMM dequantises one group of a weight tile in registers and runs two tensor-core dots per group (the low
  and the high halves pair with two contiguous slices of ``x``); with 16-bit activations on the GPU the
  dequantisation works on packed pairs in PTX (:func:`dequant_pairs`), about two values an instruction;
* from ``DENSE_MIN_TOKENS`` rows on (compute-bound prefill) one layer's weight is dequantised into a transient
  16-bit ``(N, K)`` buffer for cuBLAS (:func:`~llmplug.ops._qmm.dense_path`), freed after the matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._qmm import (
    add_norm_outputs,
    add_norm_ref,
    check_add_norm,
    check_rstd_parts,
    deferred_rstd_ref,
    dense_path,
    gemv_epilogue,
    gemv_rows,
    grouped_tile,
    int64_halves,
    norm_launch_args,
    smem_bytes,
    split_k_plan,
    split_k_reduce,
    store_tile,
    u32_to_f32,
)
from ._triton import (
    INTERPRET,
    call_op,
    llmplug_op,
    maybe_wrap,
    pdl_options,
    round_rne,
    tl,
    triton,
    use_triton,
    wait_inputs,
)
from ._w4_math import dequant_pairs, nibble_f32, packed_dequant, packed_gemv, word_dot_bf16
from .act_mul import check_gated, maybe_gated


def w4_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, bias: torch.Tensor | None = None, rstd: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference: dequantise in fp32, matmul in fp32. ``x: (M, K)`` -> ``(M, N)`` in ``x.dtype`` (``out_dtype``);
    the product times ``rstd`` (before the bias) when given."""
    from ..quant.formats import dequantize_int4

    y = x.float() @ dequantize_int4(qweight, scales, zeros, group_size, torch.float32).t()
    if rstd is not None:
        y = y * rstd
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


if triton is not None:

    @triton.jit
    def _w4_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_qn, stride_sn,
                        stride_om, res_ptr, nw_ptr, res_out_ptr, part_ptr, n_parts, eps, norm_offset,
                        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_N: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, PACKED_DOT: tl.constexpr,
                        NORM: tl.constexpr, BLOCK_P: tl.constexpr, P_CHUNKS: tl.constexpr,
                        INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        # qweight read as int32 words: word t of a group's row holds bytes 4t..4t+3, i.e. the low nibbles of
        # elements 4t..4t+3 and the high nibbles of elements HALF+4t..HALF+4t+3 (byte b at bits 8b).
        GPS: tl.constexpr = GROUPS_PER_STEP
        WORDS: tl.constexpr = GROUP // 8
        HALF: tl.constexpr = GROUP // 2
        num_groups = K // GROUP
        m = tl.program_id(0)
        pid = tl.program_id(1)
        rows, row_mask = gemv_rows(pid, N, BLOCK_N, GATED)
        gi = tl.arange(0, GPS)
        t = tl.arange(0, WORDS)
        q_ptrs = q_ptr + rows.to(tl.int64)[:, None, None] * stride_qn + (gi * WORDS)[None, :, None] + t[None, None, :]
        s_ptrs = s_ptr + rows.to(tl.int64)[:, None] * stride_sn + gi[None, :]
        z_ptrs = z_ptr + rows.to(tl.int64)[:, None] * stride_sn + gi[None, :]
        if PACKED_DOT:  # x[4t..4t+3] of each group half as one int64, split into two int32 bf16 pairs
            x_ptrs = (x_ptr.to(tl.pointer_type(tl.int64)) + m * (stride_xm // 4) + (gi * (HALF // 2))[:, None]
                      + t[None, :])
        else:
            x_ptrs = x_ptr + m * stride_xm + (gi * GROUP)[:, None, None] + 4 * t[None, :, None] + tl.arange(0, 4)
        # per (row, group, word): s * sum((q - z) * x), reduced once at the end
        acc = tl.zeros((BLOCK_N, GPS, WORDS), dtype=tl.float32)
        mask2 = row_mask[:, None] & (gi < num_groups)[None, :]
        w = tl.load(q_ptrs, mask=mask2[:, :, None], other=0)
        s = tl.load(s_ptrs, mask=mask2, other=0.0)
        z = tl.load(z_ptrs, mask=mask2, other=0.0)
        wait_inputs(PDL)  # the first step's weights are in flight; x comes from the previous kernel
        for g0 in range(0, num_groups, GPS):
            # the next step's weights, scales and zeros are loaded before this step's math: two steps in flight
            g_mask = (g0 + gi) < num_groups
            next_mask = row_mask[:, None] & ((g0 + GPS + gi) < num_groups)[None, :]
            w_next = tl.load(q_ptrs + (g0 + GPS) * WORDS, mask=next_mask[:, :, None], other=0)
            s_next = tl.load(s_ptrs + g0 + GPS, mask=next_mask, other=0.0)
            z_next = tl.load(z_ptrs + g0 + GPS, mask=next_mask, other=0.0)
            if PACKED_DOT:
                x_lo0, x_lo1 = int64_halves(tl.load(x_ptrs + g0 * (HALF // 2), mask=g_mask[:, None], other=0))
                x_hi0, x_hi1 = int64_halves(tl.load(x_ptrs + g0 * (HALF // 2) + HALF // 4, mask=g_mask[:, None],
                                                    other=0))
                z16 = (z.to(tl.float32) + 128.0).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                part = word_dot_bf16(w, (z16 | (z16 << 16))[:, :, None], x_lo0[None], x_lo1[None], x_hi0[None],
                                     x_hi1[None])
                acc += s.to(tl.float32)[:, :, None] * part
            else:
                # sum((128 + q) * x) - (128 + z) * sum(x): the zero point and the offset cost one multiply a word
                x_lo = tl.load(x_ptrs + g0 * GROUP, mask=g_mask[:, None, None], other=0.0).to(tl.float32)
                x_hi = tl.load(x_ptrs + g0 * GROUP + HALF, mask=g_mask[:, None, None], other=0.0).to(tl.float32)
                lo02, lo13 = tl.split(tl.reshape(x_lo, (GPS, WORDS, 2, 2)))  # (GPS, WORDS, 4) -> x[4t + b]
                lo0, lo2 = tl.split(lo02)
                lo1, lo3 = tl.split(lo13)
                hi02, hi13 = tl.split(tl.reshape(x_hi, (GPS, WORDS, 2, 2)))
                hi0, hi2 = tl.split(hi02)
                hi1, hi3 = tl.split(hi13)
                part = nibble_f32(w, 0) * lo0[None] + nibble_f32(w, 4) * hi0[None]
                part += nibble_f32(w, 8) * lo1[None] + nibble_f32(w, 12) * hi1[None]
                part += nibble_f32(w, 16) * lo2[None] + nibble_f32(w, 20) * hi2[None]
                part += nibble_f32(w, 24) * lo3[None] + nibble_f32(w, 28) * hi3[None]
                x_sum = (lo0 + lo1) + (lo2 + lo3) + (hi0 + hi1) + (hi2 + hi3)
                z128 = z.to(tl.float32) + 128.0
                acc += s.to(tl.float32)[:, :, None] * (part - z128[:, :, None] * x_sum[None])
            w, s, z = w_next, s_next, z_next
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        gemv_epilogue(out_ptr + m * stride_om, y, pid, rows, row_mask, N, K, b_ptr, res_ptr, res_out_ptr, nw_ptr,
                      part_ptr, n_parts, eps, norm_offset, HAS_BIAS, GATED, BLOCK_N, NORM, BLOCK_P, P_CHUNKS,
                      INTERPRETED)

    @triton.jit
    def _w4_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, GROUPS_PER_SPLIT, stride_xm, stride_qn,
                        stride_sn, stride_om, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
                        PRECISION: tl.constexpr, PACKED_DEQUANT: tl.constexpr, INTERPRETED: tl.constexpr,
                        PDL: tl.constexpr):
        wait_inputs(PDL)
        HALF: tl.constexpr = GROUP // 2
        pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        g_start = tl.program_id(1) * GROUPS_PER_SPLIT
        g_end = min(K // GROUP, g_start + GROUPS_PER_SPLIT)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        p = tl.arange(0, HALF)
        m_mask, n_mask = offs_m < M, offs_n < N
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + g_start * GROUP + p[None, :]
        q_ptrs = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn + g_start * HALF + p[None, :]
        sz_ptrs = offs_n.to(tl.int64) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(g_start, g_end):
            a_lo = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            a_hi = tl.load(x_ptrs + HALF, mask=m_mask[:, None], other=0.0)
            b = tl.load(q_ptrs, mask=n_mask[:, None], other=0)
            s = tl.load(s_ptr + sz_ptrs + g, mask=n_mask, other=0.0)[:, None]
            z = tl.load(z_ptr + sz_ptrs + g, mask=n_mask, other=0.0)[:, None]
            if PACKED_DEQUANT:  # 16-bit activations on the GPU
                w_lo, w_hi = dequant_pairs(b, tl.broadcast_to(z, (BLOCK_N, HALF)), tl.broadcast_to(s, (BLOCK_N, HALF)),
                                           x_ptr.dtype.element_ty == tl.float16)
                acc = tl.dot(a_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
                acc = tl.dot(a_hi, tl.trans(w_hi), acc, input_precision=PRECISION)
            else:
                b = b.to(tl.uint32)
                s = s.to(tl.float32)
                z = z.to(tl.float32)
                w_lo = (u32_to_f32(b & 15) - z) * s  # (BLOCK_N, HALF)
                w_hi = (u32_to_f32(b >> 4) - z) * s
                if INTERPRETED:  # the interpreter's tl.dot mishandles bf16: fp32 operands rounded as the GPU rounds
                    w_lo = round_rne(w_lo, x_ptr.dtype.element_ty)
                    w_hi = round_rne(w_hi, x_ptr.dtype.element_ty)
                    acc = tl.dot(a_lo.to(tl.float32), tl.trans(w_lo), acc, input_precision="ieee")
                    acc = tl.dot(a_hi.to(tl.float32), tl.trans(w_hi), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a_lo, tl.trans(w_lo.to(a_lo.dtype)), acc, input_precision=PRECISION)
                    acc = tl.dot(a_hi, tl.trans(w_hi.to(a_hi.dtype)), acc, input_precision=PRECISION)
            x_ptrs += GROUP
            q_ptrs += HALF
        store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om, b_ptr, HAS_BIAS, SPLIT_K, INTERPRETED)


if triton is not None:

    @triton.jit
    def _w4_dequant_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N, stride_qn, stride_sn, stride_on, GROUP: tl.constexpr,
                           BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        # program (i, g): rows i*BLOCK_N.. of group g; low nibbles -> the group's first half, high -> its second
        HALF: tl.constexpr = GROUP // 2
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        g = tl.program_id(1)
        p = tl.arange(0, HALF)
        mask = (rows < N)[:, None]
        r64 = rows.to(tl.int64)[:, None]
        b = tl.load(q_ptr + r64 * stride_qn + g * HALF + p[None, :], mask=mask, other=0).to(tl.uint32)
        s = tl.load(s_ptr + r64 * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + r64 * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
        wait_inputs(PDL)
        lo = (u32_to_f32(b & 15) - z) * s
        hi = (u32_to_f32(b >> 4) - z) * s
        if INTERPRETED:
            lo = round_rne(lo, out_ptr.dtype.element_ty)
            hi = round_rne(hi, out_ptr.dtype.element_ty)
        out = out_ptr + r64 * stride_on + g * GROUP + p[None, :]
        tl.store(out, lo.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, hi.to(out_ptr.dtype.element_ty), mask=mask)


# NOTE: dequantise + cuBLAS wins from 512 tokens (H100, 2026-11-22; BENCHMARKS.md, "Update: int4 one-token GEMV")
DENSE_MIN_TOKENS = 512


def choose_config(m: int, n: int, k: int, group_size: int, packed: bool = True, x_bytes: int = 2,
                  smem: int = 1 << 31, packed_gemv: bool = False) -> tuple[int, int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, GROUPS_PER_STEP, num_warps, num_stages, SPLIT_K)``; ``BLOCK_M == 1`` selects the GEMV
    (``GROUPS_PER_STEP`` is the GEMV's), ``SPLIT_K == 0`` lets :func:`~llmplug.ops._qmm.choose_split_k` decide.
    ``packed``: the GEMM dequantises with packed 16-bit math (CUDA, bf16/fp16 activations); ``packed_gemv``: the
    GEMV multiplies in packed bf16 pairs (:func:`packed_gemv`). The GEMM's K step is one group, so its pipeline
    depth (and, for wide groups of fp32 activations, BLOCK_M) shrinks to fit ``smem`` bytes of shared memory given
    ``x_bytes`` per activation.

    NOTE: the packed GEMV takes one token only (at two neither it nor the GEMM wins); without it (fp16, older GPUs)
    gate/up- and down-like shapes take the GEMM (H100, 2026-11-22; BENCHMARKS.md, "Figures moved from code comments").
    """
    if m == 1 and packed_gemv:  # rows a program, weights of a row a step
        if n >= 4 * k:  # gate/up
            block_n, step = 16, 512
        elif n > 4096 and k < 2 * n:  # q/k/v of the larger models
            block_n, step = 8, 1024
        else:  # o, down, small models
            block_n, step = 8, 2048
        return (1, block_n, max(1, step // group_size), 4, 1, 1)
    if m == 1 and not (packed and (n >= 4 * k or k >= 2 * n)):
        if k > n or n <= 4096:
            return (1, 16, max(1, 1024 // group_size), 8, 1, 1)
        return (1, 16, max(1, 512 // group_size), 4, 1, 1)
    if m <= 16:
        block_m, block_n, warps, stages = 16, 64 if n > k else 32, 4, 4
    elif m <= 64:
        block_m, block_n, warps, stages = 64, 64, 4, 4
    elif m <= 256:
        block_m, block_n, warps, stages = 128, 64, 4, 4
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    budget = smem - 32 * 1024  # room for the epilogue's layout conversion
    while block_m > 16 and 2 * (block_m * group_size * x_bytes + block_n * group_size // 2) > budget:
        block_m //= 2
    stage = block_m * group_size * x_bytes + block_n * group_size // 2  # x tile + packed weight tile
    return (block_m, block_n, 1, warps, max(1, min(stages, budget // stage)), 0)


@llmplug_op("w4_dequantize")
def _w4_dequantize_op(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    if not use_triton(qweight):
        from ..quant.formats import dequantize_int4

        return dequantize_int4(qweight, scales, zeros, group_size, dtype)
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n = 32
    maybe_wrap(_w4_dequant_kernel)[(triton.cdiv(n, block_n), k // group_size)](
        qweight, scales, zeros, out, n, qweight.stride(0), scales.stride(0), out.stride(0), GROUP=group_size,
        BLOCK_N=block_n, INTERPRETED=INTERPRET, num_warps=4, **pdl_options(qweight))
    return out


@_w4_dequantize_op.register_fake
def _(qweight, scales, zeros, group_size, dtype):
    return qweight.new_empty((qweight.shape[0], 2 * qweight.shape[1]), dtype=dtype)


def w4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """``W (N, K)`` in ``dtype`` from the packed ``qweight (N, K // 2)``, rounded once from the fp32 formula (as
    :func:`~llmplug.quant.formats.dequantize_int4`)."""
    return call_op(_w4_dequantize_op, qweight, scales, zeros, group_size, dtype)


def _launch_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None, gated: str, block_n: int, groups_per_step: int,
                 num_warps: int, num_stages: int, out: torch.Tensor, norm: tuple | None = None) -> torch.Tensor:
    """The one-token GEMV into ``out``; ``norm`` as :func:`~llmplug.ops._qmm.norm_launch_args`. A gated GEMV's
    program holds gate rows and their up rows."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    assert not gated or (n % 2 == 0 and block_n % 2 == 0), "gated GEMV layout"
    words = qweight.view(torch.int32)
    grid = (x.shape[0], triton.cdiv(n, block_n))
    maybe_wrap(_w4_gemv_kernel)[grid](
        x, words, scales, zeros, bias if bias is not None else scales, out, n, k, x.stride(0), words.stride(0),
        scales.stride(0), out.stride(0), HAS_BIAS=bias is not None, GATED=gated, GROUP=group_size, BLOCK_N=block_n,
        GROUPS_PER_STEP=groups_per_step, PACKED_DOT=packed_gemv(x, scales, zeros), INTERPRETED=INTERPRET,
        num_warps=num_warps, num_stages=num_stages, **norm_launch_args(norm, grid[1]), **pdl_options(x))
    return out


@llmplug_op("w4_linear")
def _w4_linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, bias: torch.Tensor | None, gated: str, block_m: int, block_n: int,
                  groups_per_step: int, num_warps: int, num_stages: int, split_k: int,
                  parts: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    if not use_triton(x):
        rstd = None if parts is None else deferred_rstd_ref(parts, x.shape[1], eps)
        return maybe_gated(w4_linear_ref(x, qweight, scales, zeros, group_size, bias, rstd), gated)
    assert x.stride(1) == 1 and qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()
    m = x.shape[0]
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    if block_m == 1:  # the GEMV applies the gate in its epilogue
        out = x.new_empty((m, n // 2 if gated else n))
        norm = None if parts is None else ("in", parts, eps)
        return _launch_gemv(x, qweight, scales, zeros, group_size, bias, gated, block_n, groups_per_step, num_warps,
                            num_stages, out, norm)
    assert parts is None, "a deferred RMSNorm needs the GEMV"
    b = bias if bias is not None else scales
    out = x.new_empty((m, n))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    per_split, split, dest = split_k_plan(split_k, tiles, k // group_size, out)
    maybe_wrap(_w4_gemm_kernel)[(tiles, split)](
        x, qweight, scales, zeros, b, dest, m, n, k, per_split, x.stride(0), qweight.stride(0), scales.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, GROUP=group_size, BLOCK_N=block_n, INTERPRETED=INTERPRET,
        num_warps=num_warps, num_stages=num_stages, BLOCK_M=block_m, SPLIT_K=split, GROUP_M=8,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PACKED_DEQUANT=packed_dequant(x, scales, zeros), **pdl_options(x))
    out = out if split == 1 else split_k_reduce(dest, bias, out)
    return maybe_gated(out, gated)


@llmplug_op("w4_linear_add_norm")
def _w4_linear_add_norm_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                           group_size: int, bias: torch.Tensor | None, residual: torch.Tensor,
                           norm_weight: torch.Tensor, offset: float, block_n: int, groups_per_step: int,
                           num_warps: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        y = w4_linear_ref(x, qweight, scales, zeros, group_size, bias, out_dtype=torch.float32)
        return add_norm_ref(y, residual, norm_weight, offset, triton.cdiv(qweight.shape[0], block_n))
    out, residual_out, parts = add_norm_outputs(x, residual, qweight.shape[0], block_n)
    _launch_gemv(x, qweight, scales, zeros, group_size, bias, "", block_n, groups_per_step, num_warps, num_stages,
                 out, ("out", residual, norm_weight, offset, residual_out, parts))
    return out, residual_out, parts


@_w4_linear_add_norm_op.register_fake
def _(x, qweight, scales, zeros, group_size, bias, residual, norm_weight, offset, block_n, groups_per_step,
      num_warps, num_stages):
    return add_norm_outputs(x, residual, qweight.shape[0], block_n)


@_w4_linear_op.register_fake
def _(x, qweight, scales, zeros, group_size, bias, gated, block_m, block_n, groups_per_step, num_warps,
      num_stages, split_k, parts=None, eps=0.0):
    return x.new_empty((x.shape[0], qweight.shape[0] // 2 if gated else qweight.shape[0]))


def _default_config(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> tuple[int, int, int, int, int, int]:
    """:func:`choose_config` for these operands."""
    return choose_config(x.shape[0], qweight.shape[0], 2 * qweight.shape[1], group_size,
                         packed=packed_dequant(x, scales, zeros), x_bytes=x.element_size(), smem=smem_bytes(x.device),
                         packed_gemv=packed_gemv(x, scales, zeros))


def uses_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int) -> bool:
    """Whether :func:`w4_linear` runs ``x`` on the GEMV (one token; some shapes take the GEMM at one token when the
    GEMV cannot multiply in packed bf16), which can start or finish an RMSNorm (:func:`w4_linear_add_norm`)."""
    return x.shape[0] == 1 and _default_config(x, qweight, scales, zeros, group_size)[0] == 1


def w4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None = None, config: tuple[int, int, int, int, int, int] | None = None,
              gated: str = "", rstd_parts: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for the packed int4 ``W`` without materialising it.

    Args:
        x: ``(M, K)`` with unit stride along K, float32 / bfloat16 / float16.
        qweight: ``(N, K // 2)`` uint8, contiguous.
        scales, zeros: ``(N, K // group_size)`` contiguous (zeros hold integers in ``[0, 15]``).
        group_size: one of 32, 64, 128, 256.
        bias: optional ``(N,)``.
        config: ``(BLOCK_M, BLOCK_N, GROUPS_PER_STEP, num_warps, num_stages, SPLIT_K)`` for the fused kernels;
            default: dequantise + cuBLAS from ``DENSE_MIN_TOKENS`` rows on the GPU, else :func:`choose_config`.
        gated: ``""``, or ``"silu"`` / ``"gelu_tanh"`` for a fused gate/up weight (gate rows, then up rows): returns
            ``act(y[:, :N/2]) * y[:, N/2:]`` (as :func:`~llmplug.ops.act_mul.act_and_mul` of the product), in the
            one-token GEMV's epilogue.
        rstd_parts, eps: ``x`` is the output of :func:`w4_linear_add_norm` (or another GEMV ending in
            :func:`~llmplug.ops._qmm.store_add_norm`) and ``rstd_parts`` its partial sums of squares: the product is
            scaled by that RMSNorm's ``rsqrt(mean square + eps)`` before the bias. One token on the GEMV only
            (:func:`uses_gemv`).

    Returns:
        ``(M, N)`` in ``x.dtype``, ``(M, N / 2)`` when gated.
    """
    n, half = qweight.shape
    check_gated(gated, n)
    k = 2 * half
    if qweight.dtype != torch.uint8:
        raise ValueError(f"qweight.dtype={qweight.dtype} must be torch.uint8 (two int4 values a byte)")
    if group_size not in (32, 64, 128, 256) or k % group_size:
        raise ValueError(f"group_size={group_size} must be one of (32, 64, 128, 256) and divide K={k}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be (M, {k}), got {tuple(x.shape)}")
    if scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
        raise ValueError(f"scales and zeros must be ({n}, {k // group_size}), got {tuple(scales.shape)} and "
                         f"{tuple(zeros.shape)}")
    if config is None and dense_path(x, DENSE_MIN_TOKENS):
        y = F.linear(x, w4_dequantize(qweight, scales, zeros, group_size, x.dtype), bias)
        return maybe_gated(y, gated)
    config = config or _default_config(x, qweight, scales, zeros, group_size)
    if rstd_parts is not None:
        check_rstd_parts(rstd_parts, x, config[0])
    return call_op(_w4_linear_op, x if x.stride(1) == 1 else x.contiguous(), qweight, scales, zeros, group_size, bias,
                   gated, *config, rstd_parts, float(eps))


def w4_linear_add_norm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group_size: int, bias: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor,
                       offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's ``y = w4_linear(x, ...)`` ending the decoder's residual add and starting its next RMSNorm, as
    :func:`~llmplug.ops.w8_linear.w8_linear_add_norm` (same arguments and results); on the GEMV only
    (:func:`uses_gemv`)."""
    check_add_norm(x, residual, norm_weight, qweight.shape[0], 2 * qweight.shape[1])
    block_m, block_n, groups_per_step, num_warps, num_stages, _ = _default_config(x, qweight, scales, zeros,
                                                                                  group_size)
    if block_m != 1:
        raise ValueError("w4_linear_add_norm needs the GEMV (uses_gemv), which this input and weight do not take")
    return call_op(_w4_linear_add_norm_op, x if x.stride(1) == 1 else x.contiguous(), qweight, scales, zeros,
                   group_size, bias, residual.contiguous(), norm_weight.contiguous(), float(offset), block_n,
                   groups_per_step, num_warps, num_stages)
