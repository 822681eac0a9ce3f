"""Decode attention over the paged KV cache: one new query token per sequence (flash-decoding).

Cache layout (shared with ``store_kv``): ``k_cache, v_cache: (num_blocks, P, Hkv, D)`` contiguous; sequence ``b``'s
``i``-th token lives in block ``block_tables[b, i // P]`` at offset ``i % P``. An fp8/int8 cache comes with
``k_scale, v_scale: (num_blocks, Hkv, P)`` fp32 (:mod:`llmplug.ops.kv_quant`).

Kernel design:

* grid ``(Hkv, B, num_splits)``. A program owns one kv head of one sequence and *all* ``H // Hkv`` query heads that
  share it (GQA): the group is the M dim of a ``tl.dot`` (padded to 16 rows), so each K/V row is read once per kv head.
  The kv head varies fastest, so a sequence's programs start together (a token's keys of every kv head are adjacent
  in a page) and programs start in row order: with rows longest first (the Engine orders its decode rows so) the
  longest contexts start first and the short ones fill the tail. NOTE: H100, 1B shape, batch 256 at contexts
  160-1152: 146 -> 123 us (79% -> 94% of the read rate; BENCHMARKS.md, "Decode attention: rows longest first").
* The context is split into ``num_splits`` contiguous ranges of ``BLOCK_N``-token tiles (flash-decoding). The split
  count depends only on static shapes (batch, kv heads, SM count, block-table width), never on ``seq_lens`` values, so
  the op is CUDA-graph safe; the tile ranges themselves are computed on the device from ``seq_lens``. With one split
  the kernel writes the output directly; otherwise each split writes an fp32 partial output plus its log-sum-exp and a
  small second kernel combines them. A split past the sequence's last tile returns at once, writing nothing (split 0
  always writes, ``lse = -inf`` when the sequence has no keys); the combine recomputes from ``seq_lens`` how many
  splits hold tiles and reads only those (:func:`~llmplug.ops._paged_decode.tile_split`).
* Inner loop: per tile, load the block ids of its tokens, gather ``BLOCK_N`` K rows (``D`` contiguous elements, stride
  ``Hkv * D`` between tokens of a page: 16-byte loads), ``q @ k^T`` in fp32, online softmax in base 2 (``log2(e)``
  folded into the scale), then ``p @ v``.
* Quantized cache: K/V tiles are loaded as stored (1 byte an element) and converted to the query dtype in registers
  (exact: every e4m3 and int8 value is a bf16/fp16 value). A token's K scale multiplies its score column after
  ``q @ k^T``; its V scale, divided by the tile's largest (so ``p`` keeps its range, which matters in fp16),
  multiplies its probability column before ``p @ v``, and that largest scale the tile's ``p @ v``. No dequantized
  copy of the cache is made.
* The same kernel serves :func:`~llmplug.ops.rope_decode_attention.rope_decode_attention` (``NEW_TOKEN``): RoPE and
  the new key's store happen inside, the new key is folded in from registers, and with ``split_counters`` the split
  of each kv head that finishes last does the combine (:func:`~llmplug.ops._paged_decode.combine_splits`)
  instead of the second kernel.
"""

from __future__ import annotations

import torch

from ._paged_decode import (
    MAX_SPLITS,
    attend_tile,
    choose_num_splits,
    combine_splits,
    fold_new_key,
    gpu_name,
    load_new_key,
    load_tile,
    sm_count,
    store_new_key,
    tile_config,
    tile_split,
    visible_keys,
)
from ._triton import (
    INTERPRET,
    call_op,
    check_out,
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
from .kv_quant import QMAX, check_scales, is_quantized, read_pages_ref
from .kv_store import check_caches
from .rope_store_kv import rope_row, rope_rows

LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # passed to the kernel as the window when there is none


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference (plain PyTorch, no host sync). ``q: (B, H, D)`` -> ``(B, H, D)`` in ``q.dtype``.

    Like eager Hugging Face attention: both matmuls in the input dtype, softcap and softmax in fp32 (fp64 for fp64
    inputs). Every sequence gathers all ``block_tables.shape[1]`` pages; positions past ``seq_lens[b]`` (or outside the
    sliding window) are masked, their K/V zeroed (garbage block ids are clamped into range), and rows with
    ``seq_lens[b] == 0`` come out as zeros. A quantized cache's gathered pages are dequantized to ``q.dtype`` first.
    """
    bsz, num_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    ctx = block_tables.shape[1] * page
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32

    ids = block_tables.long().clamp(0, num_blocks - 1)
    pos = torch.arange(ctx, device=q.device)
    n = seq_lens.long()[:, None]
    valid = pos[None, :] < n  # (B, ctx)
    if sliding_window > 0:
        valid &= pos[None, :] >= n - sliding_window
    mask4 = valid[:, :, None, None]
    blocks, offsets = ids[:, :, None].expand(-1, -1, page), torch.arange(page, device=q.device)
    k = read_pages_ref(k_cache, k_scale, blocks, offsets, q.dtype).reshape(bsz, ctx, num_kv_heads, head_dim)
    v = read_pages_ref(v_cache, v_scale, blocks, offsets, q.dtype).reshape(bsz, ctx, num_kv_heads, head_dim)
    k, v = torch.where(mask4, k, 0), torch.where(mask4, v, 0)

    qg = q.reshape(bsz, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k).to(acc) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(valid[:, None, None, :], probs, 0)  # rows with no valid key: NaN -> 0
    out = torch.einsum("bkgl,blkd->bkgd", probs.to(q.dtype), v)
    return out.reshape(bsz, num_heads, head_dim)


if triton is not None:

    @triton.jit
    def _decode_attn_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_ptr,
        lse_ptr, score_scale, cap_scale, window, num_heads, stride_qb, stride_qh, stride_cb, stride_cp, stride_ch,
        stride_sb, stride_sh, stride_bt, stride_ob, stride_oh,
        kn_ptr, vn_ptr, cos_ptr, sin_ptr, slot_ptr, stride_knb, stride_vnb, stride_cos, rope_half, counters_ptr,
        key_mask_ptr, stride_kmb,
        GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SOFTCAP: tl.constexpr,
        QUANT: tl.constexpr, QMAX_: tl.constexpr, IS_INT: tl.constexpr, NEW_TOKEN: tl.constexpr,
        LAST_COMBINES: tl.constexpr, BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
        DENSE: tl.constexpr, KEY_MASK: tl.constexpr, PDL: tl.constexpr,
    ):
        # QUANT: fp8/int8 pages with per-token scales. NEW_TOKEN: q and each sequence's newest k arrive unrotated
        # (kn_ptr, vn_ptr: (B, Hkv * D) rows); the program of the split holding the last tile rotates and stores them
        # (:func:`store_new_key`) and folds that key in from registers. The pages it reads then hold only keys of
        # earlier steps, so they may be read before the PDL wait (the kernels two or more launches back have finished
        # when this one starts: each releases its successor only after its own wait).
        # DENSE: the caches are ``(B, PAGE, Hkv, D)`` strided views, sequence ``b``'s keys all of block ``b`` (no block
        # table, ``PAGE`` keys a sequence); KEY_MASK: ``key_mask_ptr`` bytes ``(B, PAGE)`` say which keys are visible.
        # Inductor passes Python floats as fp64 (eager Triton as fp32): pin them, or the scores turn fp64.
        score_scale = tl.cast(score_scale, tl.float32)
        cap_scale = tl.cast(cap_scale, tl.float32)
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        split = tl.program_id(2)
        dt = q_ptr.dtype.element_ty
        # With the context split, a program holds few tiles (often one): its first is loaded before the wait. With
        # one split a sequence, the whole context runs through the pipelined tile loop instead.
        # (not over a dense cache: there the mask, position and RoPE rows come from kernels of the same graph)
        PRELOAD: tl.constexpr = NEW_TOKEN and NUM_SPLITS > 1 and not DENSE
        if not PRELOAD:
            wait_inputs(PDL)
        # This split's tiles (split 0 runs even without any, so the combine finds lse = -inf there).
        if DENSE:
            seq_len = PAGE
        else:
            seq_len = tl.load(seq_lens_ptr + b)
        n_keys, key_window = visible_keys(seq_len, window, NEW_TOKEN and not DENSE)
        win_start = tl.maximum(n_keys - key_window, 0)
        tile_lo, tile_hi, per_split, used = tile_split(n_keys, key_window, BLOCK_N, NUM_SPLITS)
        if NUM_SPLITS > 1:
            if split >= used:
                return
        t_start = tile_lo + split * per_split
        t_end = tl.minimum(t_start + per_split, tile_hi)

        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        km_row = key_mask_ptr + b.to(tl.int64) * stride_kmb
        k_base = k_cache_ptr + kvh.to(tl.int64) * stride_ch
        v_base = v_cache_ptr + kvh.to(tl.int64) * stride_ch
        if DENSE:
            k_base += b.to(tl.int64) * stride_cb
            v_base += b.to(tl.int64) * stride_cb
        ks_base = k_scale_ptr + kvh.to(tl.int64) * stride_sh
        vs_base = v_scale_ptr + kvh.to(tl.int64) * stride_sh
        if NEW_TOKEN and DENSE:  # one new position for every sequence: HF's ``cache_position``
            slot = tl.load(slot_ptr)
            slot = tl.where((slot >= 0) & (slot < PAGE), slot, -1)  # outside the cache: nothing stored or folded
            skip = slot
        else:
            skip = -1
        if PRELOAD:
            n_mask, k, v, k_sc, v_sc = load_tile(t_start, t_end, n_keys, win_start, bt_row, k_base, v_base, ks_base,
                                                 vs_base, stride_cb, stride_cp, stride_sb, km_row, skip, PAGE,
                                                 HEAD_DIM, BLOCK_D, BLOCK_N, QUANT, DENSE, KEY_MASK)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        if NEW_TOKEN:  # the token's RoPE row and slot: in the runtime, written before the previous kernel started
            rot, partner, cos, sin = rope_row(cos_ptr + b * stride_cos, sin_ptr + b * stride_cos, offs_d, rope_half)
            if not DENSE:
                slot = tl.load(slot_ptr + b)
            if PRELOAD:
                wait_inputs(PDL)
                # every input the q/k/v projection wrote in one round trip: the queries below and, in the split
                # that folds it in, the new key and value
                k_new, k_new_other, v_new = load_new_key(kn_ptr, vn_ptr, b, kvh, stride_knb, stride_vnb, partner,
                                                         rot, (split == used - 1) & (seq_len > 0), HEAD_DIM,
                                                         BLOCK_D)

        heads = kvh * GROUP + offs_h
        h_mask = offs_h < GROUP
        if BLOCK_D == HEAD_DIM:
            hd_mask = h_mask[:, None]
        else:
            hd_mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
        q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
        q = tl.load(q_rows + offs_d[None, :], mask=hd_mask, other=0.0)
        if NEW_TOKEN:
            q_other = tl.load(q_rows + partner[None, :], mask=hd_mask & rot[None, :], other=0.0).to(tl.float32)
            q = rope_rows(q.to(tl.float32), q_other, cos, sin, rot[None, :], dt, INTERPRETED)
            if not INTERPRETED:
                q = q.to(dt)
        if INTERPRETED:
            q = q.to(tl.float32)
        elif QUANT and dt != tl.float32:
            # fp8/int8 pages: both matmuls in fp16, to which e4m3 and int8 values convert exactly and cheaply (bf16
            # has no direct conversion from either); q and p (in [0, 1]) keep as many or more mantissa bits. Limit:
            # a bf16 query element beyond fp16's range (|q| > 65504) would overflow; queries are far smaller.
            q = q.to(tl.float16)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        t_first = t_start
        if PRELOAD:
            m_i, l_i, acc = attend_tile(q, n_mask, k, v, k_sc, v_sc, m_i, l_i, acc, score_scale, cap_scale, dt,
                                        SOFTCAP, QUANT, DOT_PRECISION, INTERPRETED)
            t_first = t_start + 1
        for t in range(t_first, t_end):
            n_mask, k, v, k_sc, v_sc = load_tile(t, t_end, n_keys, win_start, bt_row, k_base, v_base, ks_base,
                                                 vs_base, stride_cb, stride_cp, stride_sb, km_row, skip, PAGE,
                                                 HEAD_DIM, BLOCK_D, BLOCK_N, QUANT, DENSE, KEY_MASK)
            m_i, l_i, acc = attend_tile(q, n_mask, k, v, k_sc, v_sc, m_i, l_i, acc, score_scale, cap_scale, dt,
                                        SOFTCAP, QUANT, DOT_PRECISION, INTERPRETED)
        if NEW_TOKEN:
            if (split == used - 1) & (seq_len > 0):
                if not PRELOAD:  # read only now: not held in registers through the tile loop
                    k_new, k_new_other, v_new = load_new_key(kn_ptr, vn_ptr, b, kvh, stride_knb, stride_vnb,
                                                             partner, rot, seq_len > 0, HEAD_DIM, BLOCK_D)
                if DENSE:  # the caches' strided (B, PAGE, Hkv, D) view
                    row = b.to(tl.int64) * stride_cb + slot * stride_cp + kvh.to(tl.int64) * stride_ch
                else:
                    row = (slot * (num_heads // GROUP) + kvh) * HEAD_DIM
                k_new, v_new, k_new_sc, v_new_sc = store_new_key(
                    k_new, k_new_other, v_new, cos, sin, rot, slot, row, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                    v_scale_ptr, kvh, num_heads // GROUP, PAGE, dt, HEAD_DIM, BLOCK_D, QMAX_, IS_INT, INTERPRETED)
                m_f, l_f, acc_f = fold_new_key(q, k_new, v_new, k_new_sc, v_new_sc, m_i, l_i, acc, score_scale,
                                               cap_scale, dt, SOFTCAP, QUANT, INTERPRETED)
                if DENSE:  # stored whatever the mask says, attended where it shows the key
                    seen = slot >= 0
                    if KEY_MASK:
                        seen = seen & (tl.load(km_row + slot, mask=seen, other=0) != 0)
                    m_i = tl.where(seen, m_f, m_i)
                    l_i = tl.where(seen, l_f, l_i)
                    acc = tl.where(seen, acc_f, acc)
                else:
                    m_i, l_i, acc = m_f, l_f, acc_f

        has_keys = l_i > 0.0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # no keys (padding row / empty split): zeros
        if NUM_SPLITS == 1:
            if INTERPRETED:
                out = round_rne(out, out_ptr.dtype.element_ty)
            o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
        else:
            row = (b * num_heads + heads).to(tl.int64) * NUM_SPLITS + split
            tl.store(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=hd_mask)
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + row, lse, mask=h_mask)
            if LAST_COMBINES:  # the split that finishes last for this kv head combines them all, no second kernel
                tl.debug_barrier()  # every thread's partial is written before the release below
                counter = counters_ptr + b * (num_heads // GROUP) + kvh
                if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
                    tl.store(counter, 0)  # zeros again for the next launch
                    combine_splits(part_ptr, lse_ptr, out_ptr, b, heads, h_mask, used, num_heads, stride_ob,
                                   stride_oh, NUM_SPLITS, HEAD_DIM, BLOCK_D, BLOCK_S, INTERPRETED)

    @triton.jit
    def _decode_attn_combine_kernel(
        part_ptr,
        lse_ptr,
        seq_lens_ptr,
        out_ptr,
        window,
        num_heads,
        stride_ob,
        stride_oh,
        NUM_SPLITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NEW_TOKEN: tl.constexpr,
        INTERPRETED: tl.constexpr,
        DENSE_LEN: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # DENSE_LEN > 0: every sequence has that many keys (a dense cache; ``seq_lens_ptr`` is not read).
        # NOTE: one head a program; combine_splits here was slower (H100, 2026-11-22; BENCHMARKS.md, "Latest: RoPE")
        wait_inputs(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        row0 = (b * num_heads + h).to(tl.int64) * NUM_SPLITS
        if DENSE_LEN > 0:
            seq_len = DENSE_LEN
        else:
            seq_len = tl.load(seq_lens_ptr + b)
        n_keys, key_window = visible_keys(seq_len, window, NEW_TOKEN)
        n_used = tile_split(n_keys, key_window, BLOCK_N, NUM_SPLITS)[3]  # the others wrote nothing
        lse = tl.load(lse_ptr + row0 + offs_s, mask=offs_s < n_used, other=float("-inf"))
        used = lse > float("-inf")  # -inf: no keys in the sequence
        m = tl.max(lse, 0)
        m = tl.where(m > float("-inf"), m, 0.0)
        w = tl.where(used, tl.exp2(lse - m), 0.0)
        part = tl.load(
            part_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=used[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )
        total = tl.sum(w, 0)
        out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
        if INTERPRETED:
            out = round_rne(out, out_ptr.dtype.element_ty)
        o_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_d
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def launch_splits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor | None,
                  sliding_window: int) -> int:
    """The flash-decoding split count a launch over ``q: (B, H, D)`` and these pages (``block_tables`` None: one
    page a sequence, a dense cache) picks (static shapes only)."""
    block_d = max(16, next_pow2(q.shape[-1]))
    block_n = tile_config(block_d, q.element_size(), k_cache.element_size(), q.shape[0] * k_cache.shape[2],
                          gpu_name(q.device))[0]
    max_context = k_cache.shape[1] * (1 if block_tables is None else block_tables.shape[1])
    if sliding_window is not None and sliding_window > 0:
        max_context = min(max_context, sliding_window + block_n)
    if block_tables is None:  # a dense cache: up to a split a tile, rounded up (a split past the tiles exits)
        # NOTE: the faster split counts at 384 and 1,024 slots (H200, 2026-12-02; BENCHMARKS.md, "Dense decode splits")
        tiles = next_pow2(triton.cdiv(max_context, block_n))
        return choose_num_splits(q.shape[0], k_cache.shape[2], tiles * block_n, block_n, sm_count(q.device),
                                 min_tiles=1)
    return choose_num_splits(q.shape[0], k_cache.shape[2], max_context, block_n, sm_count(q.device))


def launch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor | None, seq_lens: torch.Tensor | None, scale: float,
                            sliding_window: int, softcap: float, num_splits: int,
                            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                            new_token: tuple | None = None,
                            split_counters: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The decode attention kernels on validated inputs (see :func:`decode_attention`) -> ``(B, H, D)``.

    ``new_token = (k, v, cos, sin, slot_mapping)``: ``q`` and each sequence's newest key ``k, v: (B, Hkv, D)`` come
    unrotated; the kernel rotates them (RoPE, ``cos, sin: (B, R)``), stores ``k, v`` at ``slot_mapping (B,)`` and
    attends over the ``seq_lens - 1`` keys already in the pages plus that one
    (:func:`llmplug.ops.rope_decode_attention.rope_decode_attention`). ``split_counters``: ``(>= B * Hkv,)`` int32
    zeros (left zeros) through which the last split of each kv head to finish finds out and combines the splits
    itself, instead of a second kernel. ``out``: ``(B, H, D)`` to write into (unit stride on the last dim), else a new
    tensor.

    ``block_tables`` and ``seq_lens`` None: a dense cache, ``k_cache, v_cache: (B, P, Hkv, D)`` views of any strides
    (unit stride on the last dim, one set for both), sequence ``b``'s ``P`` keys in row ``b``
    (:mod:`llmplug.ops.dense_decode_attention`); ``key_mask``: ``(B, P)`` uint8, unit stride on the last dim (any on
    the first), non-zero where a key is visible. A dense ``new_token``'s ``slot_mapping`` is one ``(1,)`` position
    for every row: its key is stored there, left out of the tile loop and folded in where ``key_mask`` shows it
    (:mod:`llmplug.ops.rope_dense_decode_attention`).
    """
    dense = block_tables is None
    assert q.stride(-1) == 1, "q needs unit stride on the last dim"
    if dense:
        assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride(), "dense caches: one layout, unit D"
        assert k_scale is None, "a dense cache is not quantized"
    else:
        assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert key_mask is None or (key_mask.dtype == torch.uint8 and key_mask.stride(-1) == 1), "key_mask: (B, P) uint8"
    assert k_cache.shape == v_cache.shape, "k_cache and v_cache must have one shape (the kernel shares their strides)"
    bsz, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = q.new_empty((bsz, num_heads, head_dim)) if out is None else out
    if bsz == 0:
        return out
    if bsz > 65535:  # the grid's second dimension
        raise ValueError(f"decode attention takes at most 65535 rows a launch, got {bsz}")

    block_d = max(16, next_pow2(head_dim))
    block_n, num_warps, num_stages = tile_config(block_d, q.element_size(), k_cache.element_size(),
                                                 bsz * num_kv_heads, gpu_name(q.device))
    splits = num_splits if num_splits > 0 else launch_splits(q, k_cache, block_tables, sliding_window)
    if splits > 1:
        part = torch.empty((bsz, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((bsz, num_heads, splits), dtype=torch.float32, device=q.device)
    else:  # the kernel writes ``out`` directly; placeholders, never touched
        part = lse = torch.empty(1, dtype=torch.float32, device=q.device)

    if softcap > 0:
        score_scale, cap_scale = scale / softcap, softcap * LOG2E
    else:
        score_scale, cap_scale = scale * LOG2E, 1.0
    quant = k_scale is not None
    window = sliding_window if sliding_window > 0 else _NO_WINDOW
    scale_strides = (k_scale.stride(0), k_scale.stride(1)) if quant else (0, 0)
    last_combines = splits > 1 and split_counters is not None
    assert not last_combines or split_counters.numel() >= bsz * num_kv_heads, "split_counters too short"
    if new_token is not None:
        k, v, cos, sin, slots = new_token
        assert k.stride(1) == v.stride(1) == head_dim and cos.stride() == sin.stride(), "rope_decode_attention layout"
        new_args = (k, v, cos, sin, slots, k.stride(0), v.stride(0), cos.stride(0), cos.shape[-1] // 2)
    else:  # placeholders, never touched
        new_args = (q, q, q, q, seq_lens, 0, 0, 0, 0)
    if dense:  # placeholders, never touched
        block_tables = seq_lens = torch.empty(1, dtype=torch.int32, device=q.device)
    masked = key_mask is not None
    maybe_wrap(_decode_attn_kernel)[(num_kv_heads, bsz, splits)](
        q, k_cache, v_cache,
        k_scale if quant else k_cache, v_scale if quant else v_cache,  # placeholders, never touched
        block_tables, seq_lens, out, part, lse, score_scale, cap_scale,
        window, num_heads, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides, block_tables.stride(0),
        out.stride(0), out.stride(1), *new_args, split_counters if split_counters is not None else seq_lens,
        key_mask if masked else seq_lens, key_mask.stride(0) if masked else 0,  # a placeholder without a mask
        GROUP=group, PAGE=page, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=max(16, next_pow2(group)),
        BLOCK_N=block_n, NUM_SPLITS=splits, SOFTCAP=softcap > 0, QUANT=quant,
        QMAX_=QMAX[k_cache.dtype] if quant else 0.0, IS_INT=k_cache.dtype == torch.int8,
        NEW_TOKEN=new_token is not None, LAST_COMBINES=last_combines, BLOCK_S=next_pow2(splits),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Interpreter workarounds: its tl.dot mishandles bf16 and it truncates fp32 -> bf16 casts (see ``round_rne``).
        INTERPRETED=INTERPRET, DENSE=dense, KEY_MASK=masked, num_warps=num_warps, num_stages=num_stages,
        **pdl_options(q),
    )
    if splits > 1 and not last_combines:
        maybe_wrap(_decode_attn_combine_kernel)[(bsz, num_heads)](
            part, lse, seq_lens, out, window, num_heads, out.stride(0), out.stride(1), NUM_SPLITS=splits,
            HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_S=next_pow2(splits), BLOCK_D=block_d,
            NEW_TOKEN=new_token is not None and not dense, INTERPRETED=INTERPRET, DENSE_LEN=page if dense else 0,
            num_warps=1 if block_d <= 64 else 2, **pdl_options(q),
        )
    return out


@llmplug_op("decode_attention", mutates_args=("out",))
def _decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    num_splits: int,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if not use_triton(q):
        out.copy_(decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap,
                                       k_scale, v_scale))
        return
    launch_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap, num_splits,
                            k_scale, v_scale, out=out)


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap, num_splits, out, k_scale=None,
      v_scale=None):
    return None


QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the decode kernels take (dense ones too)


def check_decode_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, sliding_window: int | None, softcap: float | None,
                        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                        _num_splits: int) -> tuple[int, float]:
    """Raise ``ValueError`` naming the bad value unless :func:`decode_attention` can take these inputs; returns the
    window and softcap normalised (``-1`` / ``0.0`` for none)."""
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H, D), got shape {tuple(q.shape)}")
    check_caches(k_cache, v_cache)
    bsz, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head dim mismatch: q has D={head_dim}, k_cache has D={k_cache.shape[3]}")
    if head_dim > 256:
        raise ValueError(f"head dim D={head_dim} > 256 is not supported")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"H={num_heads} query heads is not a multiple of Hkv={num_kv_heads} kv heads")
    if q.dtype not in QUERY_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported; use one of {QUERY_DTYPES}")
    if k_cache.dtype != v_cache.dtype or not (q.dtype == k_cache.dtype or is_quantized(k_cache.dtype)):
        raise ValueError(f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    check_scales(k_cache, v_cache, k_scale, v_scale)
    if block_tables.dim() != 2 or block_tables.shape[0] != bsz:
        raise ValueError(f"block_tables must be ({bsz}, M), got shape {tuple(block_tables.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != bsz:
        raise ValueError(f"seq_lens must be ({bsz},), got shape {tuple(seq_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if _num_splits < 0 or _num_splits > MAX_SPLITS:
        raise ValueError(f"_num_splits={_num_splits} must be in [0, {MAX_SPLITS}]")
    return (-1 if sliding_window is None or sliding_window <= 0 else int(sliding_window),
            0.0 if softcap is None or softcap <= 0 else float(softcap))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = -1,
    softcap: float | None = 0.0,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    _num_splits: int = 0,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV cache.

    Args:
        q: ``(B, H, D)`` fp16/bf16/fp32 queries; may be a strided view (last dim unit stride). ``D <= 256``.
        k_cache: ``(num_blocks, P, Hkv, D)`` contiguous, dtype ``q.dtype`` or fp8 e4m3 / int8; ``H`` must be a
            multiple of ``Hkv`` (query head ``h`` uses kv head ``h // (H // Hkv)``).
        v_cache: ``(num_blocks, P, Hkv, D)`` contiguous, dtype of ``k_cache``.
        block_tables: ``(B, M)`` int32; sequence ``b``'s token ``i`` is at ``block_tables[b, i // P]``, offset
            ``i % P``. Entries past a sequence's last page are never read.
        seq_lens: ``(B,)`` int32 tokens of each sequence in the cache, including the current one (already stored).
            0 marks a padding row: its output is zeros.
        scale: softmax scale (usually ``D ** -0.5``).
        sliding_window: the query at position ``p = seq_lens[b] - 1`` sees keys at positions ``> p - sliding_window``;
            ``-1`` (or ``None``, or any value ``<= 0``) means no window.
        softcap: if ``> 0``, scores become ``softcap * tanh(scores * scale / softcap)`` (Gemma 2/3); 0 or ``None``
            means none.
        k_scale, v_scale: ``(num_blocks, Hkv, P)`` fp32 scales of an fp8/int8 cache (the pages read as
            ``value * scale``, :mod:`llmplug.ops.kv_quant`); None for a cache in ``q.dtype``.
        out: ``(B, H, D)`` in ``q.dtype`` to write the result into (e.g. rows of a larger buffer; unit stride on the
            last dim); None returns a new tensor.
        _num_splits: private override of the flash-decoding split count (tests); 0 picks it from shapes.

    Returns:
        ``(B, H, D)`` in ``q.dtype``: ``out``, or a new contiguous tensor.
    """
    sliding_window, softcap = check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, sliding_window, softcap,
                                                  k_scale, v_scale, _num_splits)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if out is None:
        out = q.new_empty(q.shape)
    else:
        check_out(out, q)
    call_op(_decode_attention_op, q, k_cache, v_cache, block_tables, seq_lens, float(scale), sliding_window, softcap,
            int(_num_splits), out, k_scale, v_scale)
    return out
