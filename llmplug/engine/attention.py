"""llmplug's attention: write new K/V into the paged pool, then attend over the pages.

Reached two ways: from any HF model through ``transformers.AttentionInterface`` (:func:`hf_paged_attention`,
registered as ``"llmplug"``), and directly from the fused family forwards (:func:`rope_paged_attention`, RoPE
included).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from ..ops.decode_attention import decode_attention, launch_splits
from ..ops.kv_store import store_kv
from ..ops.prefill_attention import prefill_attention
from ..ops.rope_decode_attention import rope_decode_attention
from ..ops.rope_store_kv import rope_store_kv
from .metadata import AttentionMetadata

ATTENTION_NAME = "llmplug"
RUNTIME_ATTR = "_llmplug_runtime"


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                    softcap: float | None = None, stored: bool = False, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Store ``k, v`` into the pages (unless ``stored``: the caller already did) and attend.

    Args:
        q: ``(T, H, D)``; k, v: ``(T, Hkv, D)`` (strided views allowed, last dim contiguous).
        k_cache, v_cache: ``(num_blocks, P, Hkv, D)`` this layer's pages (model dtype, or fp8/int8).
        meta: the step's :class:`AttentionMetadata`.
        k_scale, v_scale: ``(num_blocks, Hkv, P)`` fp32 scales of fp8/int8 pages; None otherwise.

    Returns:
        ``(T, H, D)`` contiguous.
    """
    window = -1 if sliding_window is None else int(sliding_window)
    cap = 0.0 if softcap is None else float(softcap)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    if not stored:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    # NOTE: combine kernel beat last-split combining (H100, 2026-11-22; BENCHMARKS.md, "Tried, not kept: a persistent")
    if meta.is_decode:
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window, cap, **scales)
    if meta.token_seq_lens is not None:  # a short uniform step: every token a decode row attending up to itself
        return decode_attention(q, k_cache, v_cache, meta.token_block_tables, meta.token_seq_lens, scale, window, cap,
                                **scales)
    nd = meta.num_decodes
    if nd == 0:
        return prefill_attention(q, k, v, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                 meta.max_seqlen_q, scale, window, cap, **scales)
    # a mixed step: one-token rows on the decode kernel (one K/V read per head group), the rest on the prefill kernel
    # (whose sequences start at row cu_seqlens_q[nd]), each writing its rows of one output. In a captured step
    # (:mod:`~llmplug.engine.packed_graphs`) the first nd rows include padding ones (seq_lens 0): the decode kernel
    # zeroes them, then the prefill kernel writes the rows that are really its own.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens, scale, window, cap,
                     out=out[:nd], _num_splits=meta.num_splits, **scales)
    if nd < meta.block_tables.shape[0]:
        prefill_attention(q, k, v, k_cache, v_cache, meta.block_tables[nd:], meta.cu_seqlens_q[nd:],
                          meta.context_lens[nd:], meta.max_seqlen_q, scale, window, cap, out=out, **scales)
    return out


def rope_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                         sliding_window: int | None = None, softcap: float | None = None,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                         split_counters: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`paged_attention` of ``q, k`` before RoPE (``cos, sin: (T, R)``, HF ``rotate_half``); ``q, k`` may be
    rotated in place. ``split_counters``: the cache's (``PagedKVCache.split_counters``).

    Decode steps whose context the kernel splits run RoPE, the store, attention and the split combine as one kernel
    (:func:`~llmplug.ops.rope_decode_attention.rope_decode_attention`); other steps rotate and store
    (:func:`~llmplug.ops.rope_store_kv.rope_store_kv`), then attend. NOTE: one kernel is faster where the context
    splits, two where it does not (H100, 2026-11-22; BENCHMARKS.md, "Latest: RoPE, the KV store, decode attention").
    """
    if meta.is_decode and launch_splits(q, k_cache, meta.block_tables, sliding_window) > 1:
        if split_counters is not None and split_counters.numel() < k.shape[0] * k.shape[1]:
            split_counters = None
        return rope_decode_attention(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                                     meta.seq_lens, scale, sliding_window, softcap, k_scale=k_scale, v_scale=v_scale,
                                     split_counters=split_counters)
    rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    return paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, softcap, stored=True,
                           k_scale=k_scale, v_scale=v_scale)


@torch.compiler.disable  # it reads the step's metadata when it runs: a compiled stack breaks its graph here
def hf_paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """``AttentionInterface`` entry: ``query (1, H, T, D)``, ``key/value (1, Hkv, T, D)`` -> ``((1, T, H, D), None)``.

    The runtime (pages, step metadata) hangs off the attention module; the mask is unused (positions and
    sequence boundaries come from the metadata).
    """
    runtime = getattr(module, RUNTIME_ATTR, None)
    if runtime is None or runtime.meta is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} runs only inside llmplug's generate; "
            "this module was not optimized by llmplug or is being called outside a llmplug step"
        )
    if query.shape[0] != 1:
        raise RuntimeError(f"llmplug packs tokens into batch 1, got query batch {query.shape[0]}")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    k_cache, v_cache, k_scale, v_scale = runtime.cache.layer(module.layer_idx)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = paged_attention(q, k, v, k_cache, v_cache, runtime.meta, scale, sliding_window, softcap, k_scale=k_scale,
                          v_scale=v_scale)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, hf_paged_attention)
