"""int4 nibble arithmetic for :mod:`llmplug.ops.w4_linear`: the exact decodes and the packed 16-bit PTX the GEMV
and the GEMM use, and the checks of when the packed paths apply (GPU, dtype, compute capability)."""

from __future__ import annotations

import functools

import torch

from ._qmm import field_f32, reads_bf16_quads
from ._triton import INTERPRET, tl, triton

if triton is not None:

    @triton.jit
    def nibble_f32(w, SHIFT: tl.constexpr):
        """``128 +`` the nibble at bit ``SHIFT`` of each int32 word, exactly, as float32."""
        return field_f32(w, SHIFT, 4, 7)

    # One int32 word of a group's row (bytes 4t..4t+3: low nibbles of elements 4t..4t+3, high nibbles of
    # HALF+4t..HALF+4t+3) against its eight activations in packed bf16 pairs: $1 the word, $2 (128 + zero) twice,
    # $3 $4 x[4t..4t+3], $5 $6 x[HALF+4t..HALF+4t+3]; out $0 the fp32 bits of sum((q - zero) * x).
    _WORD_DOT_BF16 = tl.constexpr("{" + " ".join([
        ".reg .b32 a, b, c, d, z;", "mov.b32 z, 0;",
        "prmt.b32 a, $1, z, 0x4140;", "prmt.b32 b, $1, z, 0x4342;",  # bytes (0, 1) and (2, 3) into word halves
        "shr.b32 c, a, 4;", "shr.b32 d, b, 4;",  # their high nibbles
        *[f"lop3.b32 {r}, {r}, 0x000F000F, 0x43004300, 0xEA;" for r in "abcd"],  # bf16 128 + q, exact
        *[f"sub.rn.bf16x2 {r}, {r}, $2;" for r in "abcd"],  # q - zero, exact
        "mul.rn.bf16x2 a, a, $3;", "fma.rn.bf16x2 a, b, $4, a;", "fma.rn.bf16x2 a, c, $5, a;",
        "fma.rn.bf16x2 a, d, $6, a;",
        "shl.b32 b, a, 16;", "and.b32 a, a, 0xFFFF0000;", "add.f32 $0, a, b;"]) + "}")

    @triton.jit
    def word_dot_bf16(w, zero2, x_lo0, x_lo1, x_hi0, x_hi1):
        """GPU only (sm_90: packed bf16 ``sub``/``mul``). fp32 ``sum((q - zero) * x)`` over the eight nibbles of
        each int32 word ``w``, the products and their running sum in packed bf16 pairs: about two instructions a
        weight against eight for the fp32 formula. ``zero2`` holds ``128 + zero`` in both bf16 halves; the ``x_*``
        are bf16 pairs as int32 (the one-token GEMV of :mod:`~llmplug.ops.w4_linear` describes the layout). Every
        tensor is int32, one shape.
        """
        return tl.inline_asm_elementwise(
            asm=_WORD_DOT_BF16, constraints="=r,r,r,r,r,r,r", args=[w, zero2, x_lo0, x_lo1, x_hi0, x_hi1],
            dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)

    def _dequant_asm(magic: str, suffix: str) -> tl.constexpr:
        """PTX for :func:`dequant_pairs` on four bytes: ``$4`` the bytes, ``$5, $6`` the zero points (plus the
        offset), ``$7, $8`` the scales, two 16-bit values a register; out ``$0, $1`` low nibbles, ``$2, $3`` high."""
        spread = [f"prmt.b32 t{i}, $4, z, {sel};" for i, sel in enumerate(("0x4140", "0x4342"))]
        shift = [f"shr.b32 t{i + 2}, t{i}, 4;" for i in range(2)]
        magic_or = [f"lop3.b32 ${o}, t{o}, 0x000F000F, {magic}, 0xEA;" for o in range(4)]
        sub = [f"sub.rn.{suffix} ${o}, ${o}, ${5 + o % 2};" for o in range(4)]
        mul = [f"mul.rn.{suffix} ${o}, ${o}, ${7 + o % 2};" for o in range(4)]
        lines = [".reg .b32 t0, t1, t2, t3, z;", "mov.b32 z, 0;", *spread, *shift, *magic_or, *sub, *mul]
        return tl.constexpr("{" + " ".join(lines) + "}")

    _DEQUANT_BF16 = _dequant_asm("0x43004300", "bf16x2")  # bf16 128 + q
    _DEQUANT_F16 = _dequant_asm("0x64006400", "f16x2")  # fp16 1024 + q

    @triton.jit
    def dequant_pairs(b, zero, scale, HALF_FLOAT: tl.constexpr):
        """GPU only. ``b`` uint8 bytes, ``zero, scale`` of one shape in the 16-bit model dtype -> ``(lo, hi)`` in that
        dtype: ``(nibble - zero) * scale`` for the low and the high nibbles, rounded once, as the fp32 formula rounds.

        Four bytes at a time in PTX: ``prmt`` spreads two bytes into the halves of a word, one ``lop3`` ORs their
        nibbles into the mantissa of 128 (bf16) or 1024 (fp16) so each half reads ``offset + q`` exactly, then packed
        ``sub`` (``offset + zero``, exact) and ``mul`` (one rounding) finish two values an instruction.
        """
        if HALF_FLOAT:
            return tl.inline_asm_elementwise(
                asm=_DEQUANT_F16, constraints="=r,=r,=r,=r,r,r,r,r,r",
                args=[b, (zero + 1024.0).to(scale.dtype), scale], dtype=(scale.dtype, scale.dtype), is_pure=True,
                pack=4)
        else:
            return tl.inline_asm_elementwise(
                asm=_DEQUANT_BF16, constraints="=r,=r,=r,=r,r,r,r,r,r",
                args=[b, (zero + 128.0).to(scale.dtype), scale], dtype=(scale.dtype, scale.dtype), is_pure=True,
                pack=4)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def packed_dequant(x: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """Whether the GEMM dequantises with packed 16-bit math: compiled (not interpreted) on CUDA, fp16 activations
    (``f16x2`` math, any recent GPU) or bf16 ones on sm_90+ (``sub``/``mul.bf16x2`` are Hopper instructions), with
    scales and zeros of the activations' dtype (other scales keep the fp32 formula, which rounds once from them)."""
    if INTERPRET or not x.is_cuda or not scales.dtype == zeros.dtype == x.dtype:
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return x.dtype == torch.float16 or (x.dtype == torch.bfloat16 and _capability(index) >= (9, 0))


def packed_gemv(x: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """Whether the one-token GEMV multiplies in packed bf16 pairs (:func:`word_dot_bf16`): bf16 activations,
    scales and zeros on sm_90+ (:func:`packed_dequant`), ``x`` readable four values an int64
    (:func:`~llmplug.ops._qmm.reads_bf16_quads`)."""
    return reads_bf16_quads(x) and packed_dequant(x, scales, zeros)
