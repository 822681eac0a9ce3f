"""RoPE on q/k in place and the new k/v written into the paged cache, in one launch (the fused families' path).

RoPE is HF's ``rotate_half`` style. ``cos, sin: (T, R)`` hold one row per token, as HF's rotary embedding module
computes them, so every rope type (default, linear, dynamic, yarn, llama3, ...) works unchanged; ``R < head_dim`` is
partial rotary (dims ``R:`` pass through). The store is :func:`llmplug.ops.kv_store.store_kv`'s, quantized ones
included: k and v are rotated and rounded to the model dtype, then quantized.
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
from .kv_quant import QMAX, quantize_rows
from .kv_store import check_store_inputs, store_kv_ref


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    rot = x[..., :r].float()
    rotated = torch.cat((-rot[..., r // 2 :], rot[..., : r // 2]), dim=-1)
    # HF's ``q * cos + rotate_half(q) * sin`` in the model dtype: each product rounded, then the sum
    with_cos = (rot * cos.float()[:, None, :]).to(x.dtype).float()
    with_sin = (rotated * sin.float()[:, None, :]).to(x.dtype).float()
    return torch.cat(((with_cos + with_sin).to(x.dtype), x[..., r:]), dim=-1)


def apply_rope_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE reference. ``q: (T, H, D)``, ``k: (T, Hkv, D)``, ``cos, sin: (T, R)`` -> rotated ``(q, k)``; fp32 math,
    rounded to the input dtype where HF's ``apply_rotary_pos_emb`` rounds (each product, then the sum).

    With ``h = R // 2`` and ``i < h``: ``x[i] cos[i] - x[i+h] sin[i]`` and ``x[i+h] cos[i+h] + x[i] sin[i+h]``.
    """
    return _rope_ref(q, cos, sin), _rope_ref(k, cos, sin)


def rope_store_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Reference: rotate ``q, k`` in place, then store ``k, v`` at ``slot_mapping`` (negative slots skipped)."""
    q_out, k_out = apply_rope_ref(q, k, cos, sin)
    q.copy_(q_out)
    k.copy_(k_out)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


if triton is not None:

    @triton.jit
    def rope_row(cos_ptr, sin_ptr, cols, half):
        """A token's RoPE row over columns ``cols (BLOCK_D,)`` for rotary dim ``2 * half``: ``(rot, partner, cos,
        sin)``; ``rot`` the rotated columns, ``partner`` each column's partner (``+- half``), ``cos`` (1 past the
        rotary dims) and ``sin`` negated on the first half (0 past them) in fp32, as :func:`rope_rows` takes them."""
        rot = cols < 2 * half
        partner = tl.where(cols < half, cols + half, cols - half)
        cos = tl.load(cos_ptr + cols, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + cols, mask=rot, other=0.0).to(tl.float32)
        return rot, partner, cos, tl.where(cols < half, -sin, sin)

    @triton.jit
    def mul_rn(a, b, INTERPRETED: tl.constexpr):
        """fp32 ``a * b`` (one shape) rounded on its own: no later add may contract it into a fused multiply-add, as
        HF rounds the products of its RoPE before their sum."""
        if INTERPRETED:
            return a * b
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def rope_rows(x, other, cos, sin, rotate, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
        """HF ``rotate_half`` RoPE on fp32 rows ``x: (rows, BLOCK_D)``; ``other`` holds each column's partner,
        ``cos, sin: (BLOCK_D,)`` from :func:`rope_row`, ``rotate`` (broadcast to ``x``) the elements to rotate (the
        others pass through). Rounded to ``DTYPE`` where HF rounds: each product, then the sum."""
        cos = tl.broadcast_to(cos[None, :], x.shape)
        sin = tl.broadcast_to(sin[None, :], x.shape)
        turned = rounded(mul_rn(x, cos, INTERPRETED), DTYPE, INTERPRETED) + rounded(
            mul_rn(other, sin, INTERPRETED), DTYPE, INTERPRETED)
        return rounded(tl.where(rotate, turned, x), DTYPE, INTERPRETED)

    @triton.jit
    def _rope_store_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, H, HKV,
                              D, HALF, page, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_cos, stride_sin, HEADS: tl.constexpr, BLOCK_D: tl.constexpr, QMAX_: tl.constexpr,
                              IS_INT: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        wait_inputs(PDL)
        # Program (t, j) handles heads j*HEADS.. of token t, counting q's H heads, then k's HKV, then v's HKV.
        # QMAX_ > 0: an fp8/int8 cache; k/v rows are stored quantized, scales at [slot // page, head, slot % page].
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        is_q = heads < H
        is_v = heads >= H + HKV
        valid = heads < H + 2 * HKV
        cols = tl.arange(0, BLOCK_D)
        rot, partner, cos, sin = rope_row(cos_ptr + t * stride_cos, sin_ptr + t * stride_sin, cols, HALF)
        q_row = q_ptr + t * stride_qt + heads * stride_qh
        k_row = k_ptr + t * stride_kt + (heads - H) * stride_kh
        v_row = v_ptr + t * stride_vt + (heads - H - HKV) * stride_vh
        row = tl.where(is_q, q_row, tl.where(is_v, v_row, k_row))[:, None]
        mask = valid[:, None] & (cols < D)[None, :]
        x = tl.load(row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rotate = (~is_v)[:, None] & rot[None, :]
        other = tl.load(row + partner[None, :], mask=mask & rotate, other=0.0).to(tl.float32)
        dt = q_ptr.dtype.element_ty
        y = rope_rows(x, other, cos, sin, rotate, dt, INTERPRETED).to(dt)
        tl.store(row + cols[None, :], y, mask=mask & rotate)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            kv_head = tl.where(is_v, heads - H - HKV, heads - H)
            dst = tl.where(is_v, vc_ptr, kc_ptr) + (slot * HKV + kv_head) * D
            if QMAX_ > 0:  # new names: a tensor assigned under a runtime ``if`` must keep its type
                stored, scale = quantize_rows(y.to(tl.float32), QMAX_, IS_INT, INTERPRETED)
                s_dst = tl.where(is_v, vs_ptr, ks_ptr) + (slot // page * HKV + kv_head) * page + slot % page
                tl.store(s_dst, scale, mask=valid & ~is_q)
            else:
                stored = y
            tl.store(dst[:, None] + cols[None, :], stored.to(kc_ptr.dtype.element_ty), mask=mask & (~is_q)[:, None])


@llmplug_op("rope_store_kv", mutates_args=("q", "k", "k_cache", "v_cache", "k_scale", "v_scale"))
def _rope_store_kv_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    if not use_triton(q):
        rope_store_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    assert all(x.stride(-1) == 1 for x in (q, k, v, cos, sin)), "last dims must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    t, h, d = q.shape
    hkv = k.shape[1]
    if t == 0:
        return
    block_d = next_pow2(d)
    heads = min(next_pow2(h + 2 * hkv), max(1, 2048 // block_d))
    grid = (t, triton.cdiv(h + 2 * hkv, heads))
    quantized = k_scale is not None
    k_scale, v_scale = (k_scale, v_scale) if quantized else (slot_mapping, slot_mapping)  # placeholders, never touched
    maybe_wrap(_rope_store_kv_kernel)[grid](
        q, k, v, cos, sin, k_cache, v_cache, k_scale, v_scale, slot_mapping, h, hkv, d, cos.shape[-1] // 2,
        k_cache.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), HEADS=heads, BLOCK_D=block_d,
        QMAX_=QMAX[k_cache.dtype] if quantized else 0.0, IS_INT=k_cache.dtype == torch.int8, INTERPRETED=INTERPRET,
        num_warps=max(1, min(8, heads * block_d // 256)), **pdl_options(q))


@_rope_store_kv_op.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    return None


def check_rope_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the bad value unless ``q: (T, H, D)`` goes with ``k: (T, Hkv, D)`` and ``cos, sin:
    (T, R)`` hold an even ``R <= D``."""
    if q.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be (T={k.shape[0]}, H, D={k.shape[2]}), got {tuple(q.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q.dtype={q.dtype} differs from k.dtype={k.dtype}")
    r = cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != q.shape[0]:
        raise ValueError(f"cos and sin must both be (T={q.shape[0]}, R); got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if r % 2 or not 0 < r <= q.shape[-1]:
        raise ValueError(f"rotary dim R={r} must be even and in (0, head_dim={q.shape[-1]}]")


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Rotate ``q, k`` in place (HF ``rotate_half`` RoPE on the first ``R`` dims) and store ``k, v`` into pages.

    Args:
        q: ``(T, H, D)``; k, v: ``(T, Hkv, D)``; strided views of one fused qkv tensor are fine (last dim
            contiguous).
        cos, sin: ``(T, R)``, ``R`` even, ``R <= D``.
        k_cache, v_cache: ``(num_blocks, P, Hkv, D)`` contiguous, dtype of ``k`` or fp8 e4m3 / int8.
        slot_mapping: ``(T,)`` int64 flat slot of each token; negative slots are skipped.
        k_scale, v_scale: ``(num_blocks, Hkv, P)`` fp32 scales of an fp8/int8 cache (None otherwise), as in
            :func:`llmplug.ops.kv_store.store_kv`.
    """
    check_store_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_rope_inputs(q, k, cos, sin)
    if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin)):
        raise ValueError("q, k, v, cos and sin need a unit stride on their last dim")
    call_op(_rope_store_kv_op, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
