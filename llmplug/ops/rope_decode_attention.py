"""One decode step's attention from the unrotated q/k/v: RoPE, the new key stored into the pages, and attention.

What :func:`~llmplug.ops.rope_store_kv.rope_store_kv` followed by
:func:`~llmplug.ops.decode_attention.decode_attention` compute, in one kernel (plus the split combine): the program
whose flash-decoding split holds a sequence's last tile rotates and stores that sequence's new key and value and folds
them in from registers, so no program reads them back, and the pages every program does read (keys of earlier steps)
start loading before the kernel waits for the q/k/v projection (programmatic dependent launch). Every program rotates
its own query heads. ``q`` and ``k`` are not written back: nothing reads them after attention.
"""

from __future__ import annotations

import torch

from ._triton import call_op, llmplug_op, use_triton
from .decode_attention import check_decode_inputs, decode_attention_ref, launch_decode_attention
from .kv_store import check_store_inputs, store_kv_ref
from .rope_store_kv import apply_rope_ref, check_rope_inputs


def rope_decode_attention_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
                              sliding_window=-1, softcap=0.0, k_scale=None, v_scale=None) -> torch.Tensor:
    """Reference: :func:`~llmplug.ops.rope_store_kv.apply_rope_ref`, ``store_kv_ref`` (caches written in place),
    then :func:`~llmplug.ops.decode_attention.decode_attention_ref`. ``q, k, v`` are left as they are."""
    q_rot, k_rot = apply_rope_ref(q, k, cos, sin)
    store_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return decode_attention_ref(q_rot, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap,
                                k_scale, v_scale)


@llmplug_op("rope_decode_attention", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale", "split_counters"))
def _rope_decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              scale: float, sliding_window: int, softcap: float, num_splits: int,
                              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                              split_counters: torch.Tensor | None = None) -> torch.Tensor:
    if not use_triton(q):
        return rope_decode_attention_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                         scale, sliding_window, softcap, k_scale, v_scale)
    return launch_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap,
                                   num_splits, k_scale, v_scale, new_token=(k, v, cos, sin, slot_mapping),
                                   split_counters=split_counters)


@_rope_decode_attention_op.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale, sliding_window, softcap,
      num_splits, k_scale=None, v_scale=None, split_counters=None):
    return q.new_empty(q.shape)


def rope_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                          sliding_window: int | None = -1, softcap: float | None = 0.0, *,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                          split_counters: torch.Tensor | None = None, _num_splits: int = 0) -> torch.Tensor:
    """Attention of each sequence's one new token, given its q/k/v before RoPE; stores the new k/v into the pages.

    Args:
        q: ``(B, H, D)``; k, v: ``(B, Hkv, D)`` with ``Hkv * D`` contiguous per row (views of one fused q/k/v
            projection output are fine). fp16/bf16/fp32, one dtype.
        cos, sin: ``(B, R)`` the tokens' RoPE rows (HF ``rotate_half`` on the first ``R`` dims, ``R`` even).
        k_cache, v_cache, k_scale, v_scale, block_tables: as :func:`~llmplug.ops.decode_attention.decode_attention`.
        slot_mapping: ``(B,)`` int64 flat slot of each new token: position ``seq_lens[b] - 1`` of sequence ``b``
            (negative: not stored, for padding rows).
        seq_lens: ``(B,)`` int32 tokens of each sequence including the new one (0: a padding row, output zeros).
        scale, sliding_window, softcap: as :func:`~llmplug.ops.decode_attention.decode_attention`.
        split_counters: optional ``(>= B * Hkv,)`` int32 zeros on ``q``'s device, left zeros: with them the last
            flash-decoding split of each kv head to finish combines the splits itself (no second kernel). One buffer
            for the launches of one stream; kernels running at once must not share it.
        _num_splits: private override of the flash-decoding split count (tests); 0 picks it from shapes.

    Returns:
        ``(B, H, D)`` contiguous in ``q.dtype``; ``q, k, v`` are unchanged.
    """
    check_store_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_rope_inputs(q, k, cos, sin)
    sliding_window, softcap = check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, sliding_window, softcap,
                                                  k_scale, v_scale, _num_splits)
    if any(x.stride(-1) != 1 for x in (k, v, cos, sin)):
        raise ValueError("k, v, cos and sin need a unit stride on their last dim")
    if k.stride(1) != k.shape[2] or v.stride(1) != v.shape[2]:
        raise ValueError(f"k and v need their (Hkv, D) rows contiguous, got strides {k.stride()} and {v.stride()}")
    if cos.stride() != sin.stride():
        raise ValueError(f"cos and sin need one layout, got strides {cos.stride()} and {sin.stride()}")
    if split_counters is not None and (split_counters.dtype != torch.int32 or split_counters.dim() != 1
                                       or split_counters.numel() < k.shape[0] * k.shape[1]
                                       or split_counters.device != q.device):
        raise ValueError(f"split_counters must be ({k.shape[0] * k.shape[1]},) or longer, int32 on {q.device}; got "
                         f"{tuple(split_counters.shape)} {split_counters.dtype} on {split_counters.device}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    return call_op(_rope_decode_attention_op, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
                   seq_lens, float(scale), sliding_window, softcap, int(_num_splits), k_scale, v_scale, split_counters)
