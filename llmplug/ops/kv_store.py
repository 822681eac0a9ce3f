"""Write the new tokens' K/V rows into the paged KV cache.

Cache layout (shared with ``decode_attention``): ``k_cache, v_cache: (num_blocks, P, Hkv, D)`` contiguous; a token's
flat slot is ``block_id * P + offset``. Tokens whose slot is negative are skipped (padding rows of CUDA-graph batches).
An fp8/int8 cache also takes ``k_scale, v_scale: (num_blocks, Hkv, P)`` fp32 and stores each row quantized
(:mod:`llmplug.ops.kv_quant`).
"""

from __future__ import annotations

import torch

from ._triton import INTERPRET, call_op, llmplug_op, maybe_wrap, next_pow2, tl, triton, use_triton
from .kv_quant import QMAX, check_scales, quantize_ref, quantize_rows


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Reference. Writes ``k[t]`` / ``v[t]`` into flat slot ``slot_mapping[t]`` of the caches, in place (quantized,
    with their scales, when ``k_scale, v_scale`` are given).

    Negative slots are skipped without a boolean filter (which would make shapes data-dependent: a host sync, and no
    ``torch.compile``): a skipped token is redirected to repeat the write of the first non-skipped token (same slot,
    same row), so the duplicate index writes identical values; when every token is skipped, slot 0 is rewritten with
    its own contents.
    """
    if slot_mapping.numel() == 0:
        return
    valid = slot_mapping >= 0
    first = torch.argmax(valid.to(torch.int8))  # first non-skipped token (0 if there is none)
    src = torch.where(valid, torch.arange(slot_mapping.numel(), device=slot_mapping.device), first)
    dst = slot_mapping[src].clamp_min(0)
    keep = valid[src].view(-1, 1, 1)  # all True unless every token is skipped
    page = k_cache.shape[1]
    for rows, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])
        if scale is None:
            flat.index_put_((dst,), torch.where(keep, rows[src].to(cache.dtype), flat[dst]))
            continue
        values, scales = quantize_ref(rows[src], cache.dtype)
        flat.index_put_((dst,), torch.where(keep, values, flat[dst]))
        blk, off = dst // page, dst % page
        scale[blk, :, off] = torch.where(keep[:, :, 0], scales, scale[blk, :, off])


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        slot_ptr,
        num_kv_heads,
        page,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cache_slot,
        stride_cache_head,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        QMAX_: tl.constexpr,
        IS_INT: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        # QMAX_ > 0: quantize each (token, head) row, its scale to ``[slot // page, head, slot % page]``.
        tok = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        # A skipped token (slot < 0) writes no heads (no scalar-and-tensor ``&``: the interpreter rejects it).
        heads_end = tl.where(slot >= 0, num_kv_heads, 0)
        mask = (heads[:, None] < heads_end) & (offs_d[None, :] < HEAD_DIM)
        dst = slot * stride_cache_slot + heads[:, None] * stride_cache_head + offs_d[None, :]
        k = tl.load(k_ptr + tok * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + tok * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
        if QMAX_ > 0:
            k, k_scale = quantize_rows(k.to(tl.float32), QMAX_, IS_INT, INTERPRETED)
            v, v_scale = quantize_rows(v.to(tl.float32), QMAX_, IS_INT, INTERPRETED)
            s_dst = (slot // page) * num_kv_heads * page + heads * page + slot % page
            tl.store(k_scale_ptr + s_dst, k_scale, mask=heads < heads_end)
            tl.store(v_scale_ptr + s_dst, v_scale, mask=heads < heads_end)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@llmplug_op("store_kv", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def _store_kv_op(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    if not use_triton(k):
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v need unit stride on the last dim"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_kv_heads), max(1, 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    quantized = k_scale is not None
    maybe_wrap(_store_kv_kernel)[grid](
        k,
        v,
        k_cache,
        v_cache,
        k_scale if quantized else slot_mapping,  # placeholders (no aliasing of a mutated arg), never touched
        v_scale if quantized else slot_mapping,
        slot_mapping,
        num_kv_heads,
        k_cache.shape[1],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        QMAX_=QMAX[k_cache.dtype] if quantized else 0.0,
        IS_INT=k_cache.dtype == torch.int8,
        INTERPRETED=INTERPRET,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


@_store_kv_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    return None


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``k_cache, v_cache`` are both contiguous ``(num_blocks, P, Hkv, D)`` of one shape."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4:
            raise ValueError(f"{name} must be (num_blocks, P, Hkv, D), got shape {tuple(c.shape)}")
        if not c.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")


def check_store_inputs(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming the bad value unless ``k, v: (T, Hkv, D)`` can be stored at ``slot_mapping``."""
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be (T, Hkv, D), got shape {tuple(t.shape)}")
    check_caches(k_cache, v_cache)
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(
            f"k (Hkv, D) = {tuple(k.shape[1:])} does not match k_cache (Hkv, D) = {tuple(k_cache.shape[2:])}"
        )
    if k_cache.dtype in QMAX:  # stored quantized from a float k/v
        same = k.dtype in (torch.float16, torch.bfloat16, torch.float32)
    else:
        same = k.dtype == k_cache.dtype
    if not (same and k.dtype == v.dtype and k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtype mismatch: k {k.dtype}, v {v.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    check_scales(k_cache, v_cache, k_scale, v_scale)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be ({k.shape[0]},), got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's K/V into its paged-cache slot, in place.

    Args:
        k: ``(T, Hkv, D)`` keys; may be a strided view (e.g. into a fused qkv output), last dim unit stride.
        v: ``(T, Hkv, D)`` values, same conventions as ``k``.
        k_cache: ``(num_blocks, P, Hkv, D)`` contiguous, dtype ``k.dtype`` or fp8 e4m3 / int8; written in place.
        v_cache: ``(num_blocks, P, Hkv, D)`` contiguous, dtype of ``k_cache``; written in place.
        slot_mapping: ``(T,)`` int64; token ``t`` goes to flat slot ``slot_mapping[t] = block_id * P + offset``.
            Negative slots are skipped (the cache is left untouched there).
        k_scale, v_scale: ``(num_blocks, Hkv, P)`` fp32, required for (and only for) an fp8/int8 cache: each row is
            stored quantized and its scale written to ``[slot // P, head, slot % P]`` (:mod:`llmplug.ops.kv_quant`).
    """
    check_store_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    call_op(_store_kv_op, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
