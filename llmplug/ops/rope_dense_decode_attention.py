"""One decode step's attention over Hugging Face's static cache from the unrotated q/k/v: RoPE, the new key and value
stored at the step's cache position, and attention with a key mask, in one kernel (plus the split combine).

What a compiled HF decode step does between its q/k/v projections and ``o_proj`` (``apply_rotary_pos_emb``,
``StaticCache.update``'s ``index_copy_`` and SDPA over the whole cache), put there by
:mod:`llmplug.inductor.rope_attention`: the dense mode of the paged decode kernel (:mod:`.dense_decode_attention`)
with its new-token path (:mod:`.rope_decode_attention`), the new key's slot left out of the tile loop and folded in
from registers.
"""

from __future__ import annotations

import torch

from ._triton import call_op, llmplug_op, use_triton
from .decode_attention import launch_decode_attention
from .dense_decode_attention import check_dense_inputs, dense_decode_attention_ref, kernel_layouts
from .rope_store_kv import apply_rope_ref


def rope_dense_decode_attention_ref(q, k, v, cos, sin, k_cache, v_cache, position, key_mask, scale) -> torch.Tensor:
    """Reference: RoPE (:func:`~llmplug.ops.rope_store_kv.apply_rope_ref`), ``k_cache[:, :, position] = k`` rotated
    and ``v_cache[:, :, position] = v`` in place, then
    :func:`~llmplug.ops.dense_decode_attention.dense_decode_attention_ref`."""
    q_rot, k_rot = apply_rope_ref(q, k, cos, sin)
    inside = (position >= 0) & (position < k_cache.shape[2])  # else nothing is stored
    slot = position.clamp(0, k_cache.shape[2] - 1)
    k_cache.index_copy_(2, slot, torch.where(inside, k_rot.unsqueeze(2), k_cache.index_select(2, slot)))
    v_cache.index_copy_(2, slot, torch.where(inside, v.unsqueeze(2), v_cache.index_select(2, slot)))
    return dense_decode_attention_ref(q_rot, k_cache, v_cache, key_mask, scale)


@llmplug_op("rope_dense_decode_attention", mutates_args=("k_cache", "v_cache"))
def _rope_dense_decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    position: torch.Tensor, key_mask: torch.Tensor | None,
                                    scale: float) -> torch.Tensor:
    if not use_triton(q):
        return rope_dense_decode_attention_ref(q, k, v, cos, sin, k_cache, v_cache, position, key_mask, scale)
    # the layouts Inductor hands over are HF's (see :mod:`.dense_decode_attention`); others are copied once
    q, mask = kernel_layouts(q, key_mask)
    k, v = (t if t.stride(-1) == 1 and t.stride(1) == t.shape[2] else t.contiguous() for t in (k, v))
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride(), "the caches are written where they lie"
    return launch_decode_attention(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), None, None, scale, -1, 0.0, 0,
                                   None, None, new_token=(k, v, cos, sin, position), key_mask=mask)


@_rope_dense_decode_attention_op.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, position, key_mask, scale):
    return q.new_empty(q.shape)


def rope_dense_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                position: torch.Tensor, key_mask: torch.Tensor | None = None,
                                scale: float | None = None) -> torch.Tensor:
    """Attention of one new token a sequence over a dense cache, given its q/k/v before RoPE; stores the new key
    (rotated) and value at ``position``.

    Args:
        q: ``(B, H, D)``; k, v: ``(B, Hkv, D)``, each row's ``Hkv * D`` contiguous. One dtype of fp16/bf16/fp32.
        cos, sin: ``(B, D)`` the tokens' RoPE rows, HF's layout (``rotate_half`` over all ``D`` dims); a broadcast
            batch stride of 0 is fine.
        k_cache, v_cache: ``(B, Hkv, L, D)`` of ``q``'s dtype, one layout, unit stride on ``D``: HF's ``StaticCache``
            tensors, written in place at ``position``.
        position: ``(1,)`` int64, the new token's slot in ``L`` (every sequence's: HF's ``cache_position``); one
            outside ``[0, L)`` stores nothing and adds no key.
        key_mask: ``(B, L)`` bool, True where a key (the new one included) is visible; None: every key is.
        scale: softmax scale; None means ``D ** -0.5``.

    Returns:
        ``(B, H, D)`` in ``q.dtype``; ``q, k, v`` are unchanged.
    """
    check_dense_inputs(q, k_cache, v_cache, key_mask)
    bsz, num_kv, head_dim = q.shape[0], k_cache.shape[1], q.shape[2]
    for name, t in (("k", k), ("v", v)):
        if t.shape != (bsz, num_kv, head_dim) or t.dtype != q.dtype:
            raise ValueError(f"{name} must be ({bsz}, {num_kv}, {head_dim}) {q.dtype}; got {tuple(t.shape)} {t.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != head_dim or t.shape[0] not in (1, bsz):
            raise ValueError(f"{name} must be ({bsz}, {head_dim}); got {tuple(t.shape)}")
    if position.shape != (1,) or position.dtype != torch.int64:
        raise ValueError(f"position must be (1,) int64; got {tuple(position.shape)} {position.dtype}")
    scale = head_dim ** -0.5 if scale is None else float(scale)
    cos, sin = cos.expand(bsz, head_dim), sin.expand(bsz, head_dim)
    return call_op(_rope_dense_decode_attention_op, q, k, v, cos, sin, k_cache, v_cache, position, key_mask, scale)
