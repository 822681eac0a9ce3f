"""Rotary position embedding (neox / ``rotate_half`` style), applied in place to q and k in one launch.

``cos, sin: (T, R)`` hold one row per token, as HF's rotary embedding module computes them, so every rope type
(default, linear, dynamic, yarn, llama3, ...) works unchanged. ``R < head_dim`` is partial rotary: dims ``R:`` pass
through.
"""

from __future__ import annotations

import torch

from ._triton import call_op, llmplug_op, maybe_wrap, next_pow2, tl, triton, use_triton


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    rot = x[..., :r].float()
    rotated = torch.cat((-rot[..., r // 2 :], rot[..., : r // 2]), dim=-1)
    out = rot * cos.float()[:, None, :] + rotated * sin.float()[:, None, :]
    return torch.cat((out.to(x.dtype), x[..., r:]), dim=-1)


def apply_rope_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference. ``q: (T, H, D)``, ``k: (T, Hkv, D)``, ``cos, sin: (T, R)`` -> new rotated ``(q, k)``; fp32 math."""
    return _rope_ref(q, cos, sin), _rope_ref(k, cos, sin)


if triton is not None:

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, H, n_heads, HALF, stride_qt, stride_qh, stride_kt, stride_kh,
                     stride_cos, stride_sin, HEADS: tl.constexpr, BLOCK: tl.constexpr):
        # Program (t, j) rotates heads j*HEADS .. j*HEADS+HEADS-1 of token t, counting q's H heads then k's.
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        cols = tl.arange(0, BLOCK)
        col_mask = cols < HALF
        cos1 = tl.load(cos_ptr + t * stride_cos + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        cos2 = tl.load(cos_ptr + t * stride_cos + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        sin1 = tl.load(sin_ptr + t * stride_sin + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        sin2 = tl.load(sin_ptr + t * stride_sin + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        q_heads = q_ptr + t * stride_qt + heads * stride_qh
        k_heads = k_ptr + t * stride_kt + (heads - H) * stride_kh
        ptrs = tl.where(heads < H, q_heads, k_heads)[:, None] + cols[None, :]
        mask = (heads < n_heads)[:, None] & col_mask[None, :]
        x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (x1 * cos1 - x2 * sin1).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(ptrs + HALF, (x2 * cos2 + x1 * sin2).to(q_ptr.dtype.element_ty), mask=mask)


@llmplug_op("apply_rope", mutates_args=("q", "k"))
def _apply_rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if not use_triton(q):
        q_out, k_out = apply_rope_ref(q, k, cos, sin)
        q.copy_(q_out)
        k.copy_(k_out)
        return
    assert q.dim() == 3 and k.dim() == 3 and q.stride(-1) == 1 and k.stride(-1) == 1, "q, k must be (T, heads, D)"
    assert q.dtype == k.dtype, "q and k must share a dtype"
    assert cos.shape == sin.shape and cos.stride(-1) == 1 and sin.stride(-1) == 1, "cos, sin must be (T, R)"
    t, h, hkv = q.shape[0], q.shape[1], k.shape[1]
    half = cos.shape[-1] // 2
    if t == 0 or half == 0:
        return
    block = next_pow2(half)
    heads = min(next_pow2(h + hkv), max(1, 1024 // block))
    grid = (t, triton.cdiv(h + hkv, heads))
    maybe_wrap(_rope_kernel)[grid](
        q, k, cos, sin, h, h + hkv, half, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        sin.stride(0), HEADS=heads, BLOCK=block, num_warps=max(1, min(4, heads * block // 256)))


@_apply_rope_op.register_fake
def _(q, k, cos, sin):
    return None


def apply_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first ``R`` dims of every q and k head in place, like HF's ``apply_rotary_pos_emb``.

    With ``h = R // 2`` and ``i < h``: ``x[i] <- x[i] cos[i] - x[i+h] sin[i]`` and
    ``x[i+h] <- x[i+h] cos[i+h] + x[i] sin[i+h]``; dims ``R:`` are left as they are. Math in fp32.

    Args:
        q: ``(T, H, D)`` bf16/fp16/fp32, last dim contiguous; may be a strided view into a fused qkv tensor.
        k: ``(T, Hkv, D)``, same dtype as ``q``, last dim contiguous; may be a view into the same tensor.
        cos: ``(T, R)`` with ``R`` even and ``R <= D``, fp32 or the model dtype, last dim contiguous.
        sin: ``(T, R)``, like ``cos``.
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k must be (T, H, D) and (T, Hkv, D); got {tuple(q.shape)} and {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise ValueError(f"k.dtype={k.dtype} differs from q.dtype={q.dtype}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != q.shape[0]:
        raise ValueError(f"cos and sin must both be (T={q.shape[0]}, R); got {tuple(cos.shape)} and {tuple(sin.shape)}")
    r = cos.shape[-1]
    if r % 2 or not 0 < r <= q.shape[-1]:
        raise ValueError(f"rotary dim R={r} must be even and in (0, head_dim={q.shape[-1]}]")
    call_op(_apply_rope_op, q, k, cos, sin)
