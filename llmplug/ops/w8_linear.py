"""Weight-only 8-bit linear: ``y = (x @ q^T) * scales (+ bias)`` for int8 or fp8 (e4m3) weights, one scale per row.

``x: (M, K)`` in the model dtype, ``q: (N, K)`` int8 or float8_e4m3fn, ``scales: (N,)`` float32. The weights are
dequantised in registers (no dequantised copy): the per-row scale factors out of the dot product, so the kernels
multiply raw 8-bit values and scale the finished sums.

Two kernels: a GEMV for one token (decode at batch 1: a stream of weight reads, each program owning a few whole
rows) and a tiled GEMM with tensor cores for everything else. :func:`choose_config` picks tiles per token count.
From ``DENSE_MIN_TOKENS`` rows on (compute-bound prefill) one layer's weight is dequantised into a transient 16-bit
``(N, K)`` buffer for cuBLAS instead (:func:`~llmplug.ops._qmm.dense_path`), freed after the matmul.
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
    field_f32,
    gemv_epilogue,
    gemv_rows,
    grouped_tile,
    int64_halves,
    norm_launch_args,
    reads_bf16_quads,
    split_k_plan,
    split_k_reduce,
    store_tile,
    w8_to_f32,
)
from ._triton import (
    INTERPRET,
    call_op,
    llmplug_op,
    maybe_wrap,
    next_pow2,
    pdl_options,
    round_rne,
    tl,
    triton,
    use_triton,
    wait_inputs,
)
from .act_mul import check_gated, maybe_gated

WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def w8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                  rstd: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference in fp32: ``x: (M, K)``, ``qweight: (N, K)``, ``scales: (N,)`` -> ``(M, N)`` in ``x.dtype``
    (``out_dtype``); the product times ``rstd`` (before the bias) when given."""
    y = (x.float() @ qweight.float().t()) * scales
    if rstd is not None:
        y = y * rstd
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


if triton is not None:

    @triton.jit
    def _w8_gemv_kernel(x_ptr, q_ptr, s_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_qn, stride_om,
                        res_ptr, nw_ptr, res_out_ptr, part_ptr, n_parts, eps, norm_offset,
                        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NORM: tl.constexpr, BLOCK_P: tl.constexpr, P_CHUNKS: tl.constexpr,
                        INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        wait_inputs(PDL)
        m = tl.program_id(0)  # tokens vary fastest, so programs sharing weight rows run together (L2 reuse)
        pid = tl.program_id(1)
        rows, row_mask = gemv_rows(pid, N, BLOCK_N, GATED)
        cols = tl.arange(0, BLOCK_K)
        q_ptrs = q_ptr + rows.to(tl.int64)[:, None] * stride_qn + cols[None, :]
        x_row = x_ptr + m * stride_xm
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_mask = (k + cols) < K
            w = tl.load(q_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            xk = tl.load(x_row + k + cols, mask=k_mask, other=0.0).to(tl.float32)
            acc += w8_to_f32(w) * xk[None, :]
            q_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1) * tl.load(s_ptr + rows, mask=row_mask, other=0.0)
        gemv_epilogue(out_ptr + m * stride_om, y, pid, rows, row_mask, N, K, b_ptr, res_ptr, res_out_ptr, nw_ptr,
                      part_ptr, n_parts, eps, norm_offset, HAS_BIAS, GATED, BLOCK_N, NORM, BLOCK_P, P_CHUNKS,
                      INTERPRETED)

    SIGN_BITS = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as int32: flips each byte's sign bit, q -> q + 128
    BYTE_MAGIC = 0x47000000  # float32 bits of 2^15: a byte u placed at bits 8-15 reads 32768 + u

    @triton.jit
    def byte_f32(u, magic, B: tl.constexpr, ASM: tl.constexpr, PRECISE: tl.constexpr):
        """Byte ``B`` of each int32 word plus an offset, exactly, as float32: ``32768 + u`` (``magic`` holds
        ``BYTE_MAGIC``), or ``256 + u`` when ``PRECISE`` (fp32 activations: the smaller offset cancels less).

        On the GPU one ``prmt`` builds the word ``[0x47, 0, u, 0]`` (no shift, no mask); the interpreter computes
        the same bits with a shift and a mask. ``PRECISE`` takes a shift and a mask (:func:`field_f32`)."""
        if PRECISE:
            return field_f32(u, 8 * B, 8, 8)
        if ASM:  # prmt selector: result bytes (low first) = magic's byte 0, u's byte B, magic's bytes 0 and 3
            return tl.inline_asm_elementwise(asm=f"prmt.b32 $0, $1, $2, 0x74{B}4;", constraints="=r,r,r",
                                             args=[u, magic], dtype=tl.float32, is_pure=True, pack=1)
        if B == 0:
            u = u << 8
        elif B > 1:
            u = u >> (8 * B - 8)
        return ((u & 0xFF00) | magic).to(tl.float32, bitcast=True)

    E4M3_BITS = tl.constexpr(0x07F00000)  # where an e4m3 byte's exponent and mantissa go in float32's bits
    E4M3_UNSCALE = tl.constexpr(2.0**120)  # e4m3 bits placed that way read as the value / 2^120 (bias 7, not 127)

    @triton.jit
    def e4m3_f32(w, B: tl.constexpr):
        """The float8 e4m3 value in byte ``B`` of each int32 word, times ``2^-120``, exactly, as float32: its sign moved
        to bit 31, its exponent and mantissa to bits 20-26 (two shifts and one LOP3; byte 3 one shift). Subnormal
        e4m3 values become subnormal float32 ones, which the FMAs keep (no flush to zero in these kernels)."""
        if B == 3:
            return ((w & -0x80000000) | ((w >> 4) & E4M3_BITS)).to(tl.float32, bitcast=True)
        return (((w << (24 - 8 * B)) & -0x80000000) | ((w << (20 - 8 * B)) & E4M3_BITS)).to(tl.float32, bitcast=True)

    @triton.jit
    def _word_activations(x_ptrs, k, k_mask, EVEN: tl.constexpr, X64: tl.constexpr):
        """fp32 ``x[4(k + t) + b]`` for ``b = 0..3``, each broadcastable against the ``(BLOCK_N, BLOCK_W)`` words:
        with ``X64`` one int64 a word from ``x_ptrs (BLOCK_N, BLOCK_W)`` (bf16 widened by moving its bits up),
        else four loads from ``x_ptrs (BLOCK_W,)`` (one a value), each ``(1, BLOCK_W)``."""
        if X64:
            if EVEN:
                lo, hi = int64_halves(tl.load(x_ptrs + k))
            else:
                lo, hi = int64_halves(tl.load(x_ptrs + k, mask=k_mask[None, :], other=0))
            return ((lo << 16).to(tl.float32, bitcast=True), (lo & -65536).to(tl.float32, bitcast=True),
                    (hi << 16).to(tl.float32, bitcast=True), (hi & -65536).to(tl.float32, bitcast=True))
        else:
            p = x_ptrs + 4 * k
            if EVEN:
                x0, x1, x2, x3 = tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3)
            else:
                x0 = tl.load(p, mask=k_mask, other=0.0)
                x1 = tl.load(p + 1, mask=k_mask, other=0.0)
                x2 = tl.load(p + 2, mask=k_mask, other=0.0)
                x3 = tl.load(p + 3, mask=k_mask, other=0.0)
            return (x0.to(tl.float32)[None, :], x1.to(tl.float32)[None, :], x2.to(tl.float32)[None, :],
                    x3.to(tl.float32)[None, :])

    @triton.jit
    def _w8_gemv_words_kernel(x_ptr, q_ptr, s_ptr, b_ptr, out_ptr, N, KW, stride_xm, stride_qn, stride_om, magic,
                              res_ptr, nw_ptr, res_out_ptr, part_ptr, n_parts, eps, norm_offset,
                              HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_W: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr, X64: tl.constexpr,
                              FP8: tl.constexpr, NORM: tl.constexpr, BLOCK_P: tl.constexpr, P_CHUNKS: tl.constexpr,
                              INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        # 8-bit weights read as int32 words (KW = K // 4; byte b of word t is element 4t + b). FP8: e4m3_f32 decodes
        # each byte (its value / 2^120, undone on the row scale) and a word's four products chain. int8: XOR-ing 0x80
        # into each byte gives u = q + 128 in [0, 255]; byte_f32 turns each into offset + u with one instruction, and
        # each word's four products chain onto -(offset + 128) * (its four x summed): y = sum(q * x) * scale, about 4
        # SASS instructions a weight byte against 7 with a shift and a mask a byte (sm_90 build; the GEMV stays bound by
        # loads in flight, see BENCHMARKS.md). Each step's weight tile is loaded a step ahead, the first one before
        # the programmatic-launch wait (no kernel writes weights), so it is in flight while the previous kernel ends
        # (8B int8 decode replay 3.245 -> 3.188 ms). EVEN: KW divides by BLOCK_W (unmasked activation loads).
        # GATED: see gemv_rows. X64: bf16 x read as one int64 a word (its four values), loaded by each thread in
        # the layout its words need instead of once and spread through shared memory (barriers every step).
        m = tl.program_id(0)
        pid = tl.program_id(1)
        rows, row_mask = gemv_rows(pid, N, BLOCK_N, GATED)
        t = tl.arange(0, BLOCK_W)
        q_ptrs = q_ptr + rows.to(tl.int64)[:, None] * stride_qn + t[None, :]
        if X64:
            x_ptrs = x_ptr.to(tl.pointer_type(tl.int64)) + m * (stride_xm // 4) + (t[None, :] + 0 * rows[:, None])
        else:
            x_ptrs = x_ptr + m * stride_xm + 4 * t
        magic = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.int32) + magic  # a register, so prmt takes its selector inline
        PRECISE: tl.constexpr = x_ptr.dtype.element_ty == tl.float32
        offset = -384.0 if PRECISE else -32896.0
        acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
        w_next = tl.load(q_ptrs, mask=row_mask[:, None] & (t < KW)[None, :], other=0)  # weights: before the wait
        wait_inputs(PDL)
        for k in range(0, KW, BLOCK_W):
            k_mask = (k + t) < KW  # unused when EVEN
            w = w_next
            w_next = tl.load(q_ptrs + k + BLOCK_W, mask=row_mask[:, None] & (k + BLOCK_W + t < KW)[None, :], other=0)
            x0, x1, x2, x3 = _word_activations(x_ptrs, k, k_mask, EVEN, X64)
            if FP8:
                part = tl.fma(e4m3_f32(w, 1), x1, e4m3_f32(w, 0) * x0)
                part = tl.fma(e4m3_f32(w, 2), x2, part)
                acc += tl.fma(e4m3_f32(w, 3), x3, part)
            else:
                u = w ^ SIGN_BITS
                # the offset comes off word by word, before the products add up across words (little cancellation)
                part = ((x0 + x1) + (x2 + x3)) * offset
                part = tl.fma(byte_f32(u, magic, 0, ASM, PRECISE), x0, part)
                part = tl.fma(byte_f32(u, magic, 1, ASM, PRECISE), x1, part)
                part = tl.fma(byte_f32(u, magic, 2, ASM, PRECISE), x2, part)
                acc += tl.fma(byte_f32(u, magic, 3, ASM, PRECISE), x3, part)
        scale = tl.load(s_ptr + rows, mask=row_mask, other=0.0)
        y = tl.sum(acc, axis=1) * (scale * E4M3_UNSCALE if FP8 else scale)
        gemv_epilogue(out_ptr + m * stride_om, y, pid, rows, row_mask, N, 4 * KW, b_ptr, res_ptr, res_out_ptr, nw_ptr,
                      part_ptr, n_parts, eps, norm_offset, HAS_BIAS, GATED, BLOCK_N, NORM, BLOCK_P, P_CHUNKS,
                      INTERPRETED)

    @triton.jit
    def _w8_gemm_kernel(x_ptr, q_ptr, s_ptr, b_ptr, out_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_qn, stride_om,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
                        INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        wait_inputs(PDL)
        pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        k_start = tl.program_id(1) * K_PER_SPLIT
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = k_start + tl.arange(0, BLOCK_K)
        m_mask, n_mask = offs_m < M, offs_n < N
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        q_ptrs = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_start, min(K, k_start + K_PER_SPLIT), BLOCK_K):
            k_mask = (k - k_start + offs_k) < K
            a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = w8_to_f32(tl.load(q_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0))
            if INTERPRETED:  # the interpreter's tl.dot mishandles bf16 (numpy has none): multiply in fp32 there
                acc = tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            q_ptrs += BLOCK_K
        y = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        store_tile(out_ptr, y, offs_m, offs_n, M, N, stride_om, b_ptr, HAS_BIAS, SPLIT_K, INTERPRETED)


if triton is not None:

    @triton.jit
    def _w8_dequant_kernel(q_ptr, s_ptr, out_ptr, N, K, stride_qn, stride_on, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows < N)[:, None] & (cols < K)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        w = w8_to_f32(tl.load(q_ptr + r64 * stride_qn + cols[None, :], mask=mask, other=0.0))
        s = tl.load(s_ptr + rows, mask=rows < N, other=0.0)
        wait_inputs(PDL)
        w = w * s[:, None]
        if INTERPRETED:
            w = round_rne(w, out_ptr.dtype.element_ty)
        tl.store(out_ptr + r64 * stride_on + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


# NOTE: dequantise + cuBLAS wins from 512 tokens (H100, 2026-11-22; BENCHMARKS.md, "Figures moved from code comments")
DENSE_MIN_TOKENS = 512


def choose_config(m: int, n: int, k: int, fp8: bool = False) -> tuple[int, int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K)``; ``BLOCK_M == 1`` selects the word GEMV
    (``fp8`` keeps tiles of its own), ``SPLIT_K == 0`` lets :func:`~llmplug.ops._qmm.choose_split_k` decide.

    NOTE: the one-token tiles timed best in PDL chains and 8B decode replays; the GEMMs match cuBLAS bf16 at 64 tokens
    and trail it from 256 (H100, 2026-11-22 and -26; BENCHMARKS.md, "Figures moved from code comments").
    """
    if m == 1 and fp8:
        return (1, 8, 512, 4, 3, 1) if n > k else (1, 4, 1024, 4, 3, 1)
    if m == 1:
        if n >= 4 * k:
            return (1, 8, 512, 4, 3, 1)
        return (1, 8, 1024, 4, 3, 1) if n > k else (1, 4, 1024, 4, 3, 1)
    if m <= 16:
        return (16, 32, 256, 4, 4, 0)
    if m <= 64:
        return (64, 128, 128, 4, 3, 0)
    return (128, 128, 64, 8, 3, 0)


def _launch_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, gated: str,
                 block_n: int, block_k: int, num_warps: int, num_stages: int, out: torch.Tensor,
                 norm: tuple | None = None) -> torch.Tensor:
    """The one-token GEMVs into ``out`` (K divisible by 4: the word GEMV; else the byte GEMV); ``norm`` as
    :func:`~llmplug.ops._qmm.norm_launch_args`. A gated GEMV's program holds gate rows and their up rows."""
    assert x.stride(1) == 1 and qweight.is_contiguous() and scales.dtype == torch.float32, "w8_linear layout"
    n, k = qweight.shape
    assert not gated or (n % 2 == 0 and block_n % 2 == 0), "gated GEMV layout"
    grid = (x.shape[0], triton.cdiv(n, block_n))
    common = dict(HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=block_n, INTERPRETED=INTERPRET, num_warps=num_warps,
                  num_stages=num_stages, **norm_launch_args(norm, grid[1]), **pdl_options(x))
    b = bias if bias is not None else scales
    if k % 4 == 0:
        words = qweight.view(torch.int32)
        block_w = min(block_k // 4, next_pow2(k // 4))
        maybe_wrap(_w8_gemv_words_kernel)[grid](
            x, words, scales, b, out, n, k // 4, x.stride(0), words.stride(0), out.stride(0), BYTE_MAGIC,
            BLOCK_W=block_w, EVEN=k // 4 % block_w == 0, ASM=not INTERPRET, X64=reads_bf16_quads(x),
            FP8=qweight.dtype == torch.float8_e4m3fn, **common)
    else:
        maybe_wrap(_w8_gemv_kernel)[grid](
            x, qweight, scales, b, out, n, k, x.stride(0), qweight.stride(0), out.stride(0),
            BLOCK_K=min(block_k, next_pow2(k)), **common)
    return out


@llmplug_op("w8_linear")
def _w8_linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                  gated: str, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
                  split_k: int, parts: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    if not use_triton(x):
        rstd = None if parts is None else deferred_rstd_ref(parts, x.shape[1], eps)
        return maybe_gated(w8_linear_ref(x, qweight, scales, bias, rstd), gated)
    m = x.shape[0]
    n, k = qweight.shape
    if block_m == 1:
        out = x.new_empty((m, n // 2 if gated else n))
        norm = None if parts is None else ("in", parts, eps)
        return _launch_gemv(x, qweight, scales, bias, gated, block_n, block_k, num_warps, num_stages, out, norm)
    assert parts is None, "a deferred RMSNorm needs the GEMV"
    out = x.new_empty((m, n))
    block_k = max(16, min(block_k, next_pow2(k)))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps_per_split, split, dest = split_k_plan(split_k, tiles, triton.cdiv(k, block_k), out)
    k_per_split = steps_per_split * block_k
    b = bias if bias is not None else scales
    maybe_wrap(_w8_gemm_kernel)[(tiles, split)](
        x, qweight, scales, b, dest, m, n, k, k_per_split, x.stride(0), qweight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, GROUP_M=8,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", INTERPRETED=INTERPRET, num_warps=num_warps,
        num_stages=num_stages, **pdl_options(x))
    out = out if split == 1 else split_k_reduce(dest, bias, out)
    return maybe_gated(out, gated)


@llmplug_op("w8_linear_add_norm")
def _w8_linear_add_norm_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                           residual: torch.Tensor, norm_weight: torch.Tensor, offset: float, block_n: int,
                           block_k: int, num_warps: int,
                           num_stages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        y = w8_linear_ref(x, qweight, scales, bias, out_dtype=torch.float32)
        return add_norm_ref(y, residual, norm_weight, offset, triton.cdiv(qweight.shape[0], block_n))
    out, residual_out, parts = add_norm_outputs(x, residual, qweight.shape[0], block_n)
    _launch_gemv(x, qweight, scales, bias, "", block_n, block_k, num_warps, num_stages, out,
                 ("out", residual, norm_weight, offset, residual_out, parts))
    return out, residual_out, parts


@_w8_linear_add_norm_op.register_fake
def _(x, qweight, scales, bias, residual, norm_weight, offset, block_n, block_k, num_warps, num_stages):
    return add_norm_outputs(x, residual, qweight.shape[0], block_n)


@llmplug_op("w8_dequantize")
def _w8_dequantize_op(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not use_triton(qweight):
        return (qweight.float() * scales[:, None]).to(dtype)
    n, k = qweight.shape
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    maybe_wrap(_w8_dequant_kernel)[(triton.cdiv(n, 16), triton.cdiv(k, 256))](
        qweight, scales, out, n, k, qweight.stride(0), out.stride(0), BLOCK_N=16, BLOCK_K=256, INTERPRETED=INTERPRET,
        num_warps=4, **pdl_options(qweight))
    return out


@_w8_dequantize_op.register_fake
def _(qweight, scales, dtype):
    return qweight.new_empty(qweight.shape, dtype=dtype)


def w8_dequantize(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``W (N, K) = qweight * scales[:, None]`` in ``dtype``, rounded once from fp32."""
    return call_op(_w8_dequantize_op, qweight, scales, dtype)


@_w8_linear_op.register_fake
def _(x, qweight, scales, bias, gated, block_m, block_n, block_k, num_warps, num_stages, split_k, parts=None, eps=0.0):
    return x.new_empty((x.shape[0], qweight.shape[0] // 2 if gated else qweight.shape[0]))


def w8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
              config: tuple[int, int, int, int, int, int] | None = None, gated: str = "",
              rstd_parts: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """``x @ (qweight * scales[:, None])^T (+ bias)`` without materialising the dequantised weight.

    Args:
        x: ``(M, K)`` with unit stride along K, float32 / bfloat16 / float16.
        qweight: ``(N, K)`` int8 or float8_e4m3fn, contiguous.
        scales: ``(N,)`` float32.
        bias: optional ``(N,)``.
        config: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K)`` for the fused kernels; default:
            dequantise + cuBLAS from ``DENSE_MIN_TOKENS`` rows on the GPU, else :func:`choose_config`.
        gated: ``""``, or ``"silu"`` / ``"gelu_tanh"`` for a fused gate/up weight (gate rows, then up rows): returns
            ``act(y[:, :N/2]) * y[:, N/2:]`` (as :func:`~llmplug.ops.act_mul.act_and_mul` of the product), in the
            one-token GEMV's epilogue.
        rstd_parts, eps: ``x`` is the output of :func:`w8_linear_add_norm` (or another GEMV ending in
            :func:`~llmplug.ops._qmm.store_add_norm`) and ``rstd_parts`` its partial sums of squares: the product is
            scaled by that RMSNorm's ``rsqrt(mean square + eps)`` before the bias. One token only (the GEMV).

    Returns:
        ``(M, N)`` in ``x.dtype``, ``(M, N / 2)`` when gated.
    """
    check_gated(gated, qweight.shape[0])
    n, k = qweight.shape
    if qweight.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"qweight.dtype={qweight.dtype} is not supported; choose one of {WEIGHT_DTYPES}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be (M, {k}), got {tuple(x.shape)}")
    if scales.shape != (n,):
        raise ValueError(f"scales must be ({n},), got {tuple(scales.shape)}")
    if config is None and dense_path(x, DENSE_MIN_TOKENS):
        y = F.linear(x, w8_dequantize(qweight, scales, x.dtype), bias)
        return maybe_gated(y, gated)
    config = config or choose_config(x.shape[0], n, k, fp8=qweight.dtype == torch.float8_e4m3fn)
    if rstd_parts is not None:
        check_rstd_parts(rstd_parts, x, config[0])
    return call_op(_w8_linear_op, x if x.stride(1) == 1 else x.contiguous(), qweight, scales, bias, gated, *config,
                   rstd_parts, float(eps))


def w8_linear_add_norm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                       residual: torch.Tensor, norm_weight: torch.Tensor,
                       offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's ``y = w8_linear(x, ...)`` ending the decoder's residual add and starting its next RMSNorm.

    Args:
        x: ``(1, K)``; qweight, scales, bias: as :func:`w8_linear` (``N`` the hidden size).
        residual: ``(1, N)`` in ``x.dtype``; norm_weight: ``(N,)``; offset: added to the norm weight (Gemma's 1).

    Returns:
        ``(out, residual_out, parts)``: ``residual_out = y + residual`` (rounded as HF rounds the two),
        ``out = (norm_weight + offset) * residual_out`` rounded to ``x.dtype``, and ``parts`` fp32 partial sums of
        ``residual_out ** 2`` for the next GEMV's ``rstd_parts`` (:func:`w8_linear`), which finishes the norm.
    """
    n, k = qweight.shape
    check_add_norm(x, residual, norm_weight, n, k)
    _, block_n, block_k, num_warps, num_stages, _ = choose_config(1, n, k, fp8=qweight.dtype == torch.float8_e4m3fn)
    return call_op(_w8_linear_add_norm_op, x if x.stride(1) == 1 else x.contiguous(), qweight, scales, bias,
                   residual.contiguous(), norm_weight.contiguous(), float(offset), block_n, block_k, num_warps,
                   num_stages)
