"""Pieces of the paged decode attention kernel (:mod:`llmplug.ops.decode_attention`) shared by its two modes and
its launch: the tile loop's steps, the new key's fold and store, the in-kernel split combine, and the static split
plan. The kernel's design is described in :mod:`llmplug.ops.decode_attention`."""

from __future__ import annotations

import functools

import torch

from ._triton import round_rne, rounded, tl, triton
from .kv_quant import quantize_rows, tile_v_scales
from .rope_store_kv import rope_rows

MAX_SPLITS = 64
MIN_TILES_PER_SPLIT = 4
INTERPRETER_SMS = 4  # pretend SM count under the interpreter / on CPU, so small tests still get several splits

if triton is not None:

    @triton.jit
    def accurate_tanh(x):
        # Accurate for fp32 also near 0 (1 - exp(-2|x|) cancels there): odd Taylor polynomial for |x| < 0.3.
        ax = tl.abs(x)
        x2 = x * x
        poly = -0.008863235529902197  # Taylor coefficients of tanh(x) / x in x^2, highest first
        poly = poly * x2 + 0.021869488536155203
        poly = poly * x2 - 0.05396825396825397
        poly = poly * x2 + 0.13333333333333333
        poly = poly * x2 - 0.3333333333333333
        poly = x * (poly * x2 + 1.0)
        e = tl.exp(-2.0 * ax)
        big = (1.0 - e) / (1.0 + e)
        big = tl.where(x < 0, -big, big)
        return tl.where(ax < 0.3, poly, big)

    @triton.jit
    def tile_split(seq_len, window, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
        """``(tile_lo, tile_hi, per_split, used)``: tile ``t`` covers positions ``[t * BLOCK_N, (t + 1) * BLOCK_N)``;
        the visible positions are ``[seq_len - window, seq_len)``, so every tile in ``[tile_lo, tile_hi)`` holds at
        least one visible key. Split ``s`` takes tiles ``tile_lo + s * per_split`` on; the first ``used`` splits hold
        tiles, at least one split counting as used (split 0 runs even for a sequence without keys)."""
        tile_lo = tl.maximum(seq_len - window, 0) // BLOCK_N
        tile_hi = tl.cdiv(seq_len, BLOCK_N)
        n_tiles = tl.maximum(tile_hi - tile_lo, 0)
        per_split = tl.cdiv(n_tiles, NUM_SPLITS)
        used = tl.maximum(tl.cdiv(n_tiles, tl.maximum(per_split, 1)), 1)
        return tile_lo, tile_hi, per_split, used

    @triton.jit
    def visible_keys(seq_len, window, NEW_TOKEN: tl.constexpr):
        """``(n_keys, key_window)``: the keys the tile loop reads from the pages. Without ``NEW_TOKEN`` all of
        ``seq_len``; with it the newest key is folded in from registers (:func:`fold_new_key`), so the loop reads the
        ``seq_len - 1`` older ones, of which the window keeps ``window - 1``."""
        if NEW_TOKEN:
            return tl.maximum(seq_len - 1, 0), window - 1
        return seq_len, window

    @triton.jit
    def load_tile(t, t_end, n_keys, win_start, bt_row, k_base, v_base, ks_base, vs_base, stride_cb, stride_cp,
                  stride_sb, km_row, skip, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, QUANT: tl.constexpr, DENSE: tl.constexpr, KEY_MASK: tl.constexpr):
        """Tile ``t``'s visible keys: ``(mask (BLOCK_N,), k, v (BLOCK_N, BLOCK_D) as stored, k / v scales
        (BLOCK_N,))``; nothing is read when ``t >= t_end``. The scales are zeros for an unquantized cache. ``DENSE``:
        ``k_base`` / ``v_base`` are the sequence's own ``PAGE`` tokens (no block table), position ``skip`` left out
        (the new key's slot, folded in from registers; -1: none); ``KEY_MASK``: only keys whose ``km_row`` byte (one a
        position) is non-zero are visible."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        pos = t * BLOCK_N + offs_n
        n_mask = (pos < n_keys) & (pos >= win_start) & (pos < t_end * BLOCK_N)  # t < t_end
        if DENSE:
            n_mask = n_mask & (pos != skip)
        if KEY_MASK:
            n_mask = n_mask & (tl.load(km_row + pos, mask=n_mask, other=0) != 0)
        if BLOCK_D == HEAD_DIM:
            kv_mask = n_mask[:, None]
        else:
            kv_mask = n_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
        if DENSE:
            blk = 0
            in_page = pos.to(tl.int64)
            rows = in_page * stride_cp
        else:
            # Block ids of the tile's tokens (masked: entries past the sequence are never read).
            blk = tl.load(bt_row + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
            in_page = (pos % PAGE).to(tl.int64)
            rows = blk * stride_cb + in_page * stride_cp  # K and V caches share one layout
        k = tl.load(k_base + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if QUANT:
            s_rows = blk * stride_sb + in_page
            k_sc = tl.load(ks_base + s_rows, mask=n_mask, other=0.0)
            v_sc = tl.load(vs_base + s_rows, mask=n_mask, other=0.0)
        else:
            k_sc = tl.zeros([BLOCK_N], dtype=tl.float32)
            v_sc = k_sc
        return n_mask, k, v, k_sc, v_sc

    @triton.jit
    def attend_tile(q, n_mask, k, v, k_sc, v_sc, m_i, l_i, acc, score_scale, cap_scale, DTYPE: tl.constexpr,
                    SOFTCAP: tl.constexpr, QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    INTERPRETED: tl.constexpr):
        """One online-softmax step over a tile from :func:`load_tile`: ``q @ k^T`` in fp32, base-2 softmax, ``p @ v``
        with ``p`` in the matmul dtype (``q.dtype``). Returns ``(m_i, l_i, acc)``; a tile without a visible key
        changes nothing."""
        if INTERPRETED:
            k = k.to(tl.float32)
        else:
            k = k.to(q.dtype)  # a no-op unless the cache is quantized
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_H, BLOCK_N) fp32
        if QUANT:
            qk = qk * k_sc[None, :]
        if SOFTCAP:
            s = accurate_tanh(qk * score_scale) * cap_scale
        else:
            s = qk * score_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # nothing visible yet: p and alpha come out 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:
            v_ratio, v_max = tile_v_scales(v_sc)
            p = p * v_ratio[None, :]
        # Like flash attention: P in the input dtype for the PV matmul.
        if INTERPRETED:
            p = round_rne(p, DTYPE)
            v = v.to(tl.float32)
        else:
            p = p.to(q.dtype)
            v = v.to(q.dtype)
        pv = tl.dot(p, v, input_precision=DOT_PRECISION)
        if QUANT:
            pv = pv * v_max
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def fold_new_key(q, k_new, v_new, k_sc, v_sc, m_i, l_i, acc, score_scale, cap_scale, DTYPE: tl.constexpr,
                     SOFTCAP: tl.constexpr, QUANT: tl.constexpr, INTERPRETED: tl.constexpr):
        """:func:`attend_tile` for one more key held in registers: ``k_new, v_new (1, BLOCK_D)`` fp32 as stored
        (storage-grid values with scalar-like ``(1,)`` scales ``k_sc, v_sc`` when ``QUANT``)."""
        qk = tl.sum(q.to(tl.float32) * k_new, 1)
        if QUANT:
            qk = qk * k_sc
        if SOFTCAP:
            s = accurate_tanh(qk * score_scale) * cap_scale
        else:
            s = qk * score_scale
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        if INTERPRETED:
            p = round_rne(p, DTYPE)
        else:
            p = p.to(q.dtype).to(tl.float32)
        pv = p[:, None] * v_new
        if QUANT:
            pv = pv * v_sc
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def load_new_key(kn_ptr, vn_ptr, b, kvh, stride_knb, stride_vnb, partner, rot, wanted, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr):
        """Sequence ``b``'s new key and value of kv head ``kvh`` as projected, ``(k, k at the RoPE partner columns,
        v)``, each ``(1, BLOCK_D)`` fp32; zeros (nothing read) unless ``wanted``."""
        cols = tl.arange(0, BLOCK_D)
        mask = (cols < tl.where(wanted, HEAD_DIM, 0))[None, :]
        k_row = kn_ptr + b * stride_knb + kvh * HEAD_DIM
        k = tl.load(k_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        k_other = tl.load(k_row + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
        v = tl.load(vn_ptr + b * stride_vnb + kvh * HEAD_DIM + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        return k, k_other, v

    @triton.jit
    def store_new_key(k, k_other, v, cos, sin, rot, slot, row, kc_ptr, vc_ptr, ks_ptr, vs_ptr, kvh, HKV, page,
                      DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QMAX_: tl.constexpr,
                      IS_INT: tl.constexpr, INTERPRETED: tl.constexpr):
        """A sequence's new key and value ``k, v: (1, BLOCK_D)`` fp32 as projected (``k_other``: ``k`` at the RoPE
        partner columns) of kv head ``kvh``: rotate ``k`` (:func:`~llmplug.ops.rope_store_kv.rope_rows`), round both
        to the model dtype, quantize them for an fp8/int8 cache and store them at element offset ``row`` of the caches
        (flat slot ``slot``'s row of the head; skipped when ``slot`` is negative), as
        :func:`~llmplug.ops.rope_store_kv.rope_store_kv` does. Returns ``(k, v, k_scale, v_scale)``: the rows as
        stored (fp32) and ``(1,)`` scales (ones for an unquantized cache)."""
        cols = tl.arange(0, BLOCK_D)
        d_mask = (cols < HEAD_DIM)[None, :]
        k = rope_rows(k, k_other, cos, sin, rot[None, :], DTYPE, INTERPRETED)
        v = rounded(v, DTYPE, INTERPRETED)
        dst = row + cols[None, :]
        cache_dt = kc_ptr.dtype.element_ty
        if QMAX_ > 0:
            k, k_sc = quantize_rows(k, QMAX_, IS_INT, INTERPRETED)
            v, v_sc = quantize_rows(v, QMAX_, IS_INT, INTERPRETED)
            k = k.to(cache_dt)
            v = v.to(cache_dt)
            if slot >= 0:
                s_dst = (slot // page * HKV + kvh) * page + slot % page + tl.zeros([1], dtype=tl.int64)
                tl.store(ks_ptr + s_dst, k_sc)
                tl.store(vs_ptr + s_dst, v_sc)
        else:
            k = k.to(cache_dt)
            v = v.to(cache_dt)
            k_sc = tl.full([1], 1.0, dtype=tl.float32)
            v_sc = k_sc
        if slot >= 0:
            tl.store(kc_ptr + dst, k, mask=d_mask)
            tl.store(vc_ptr + dst, v, mask=d_mask)
        return k.to(tl.float32), v.to(tl.float32), k_sc, v_sc

    @triton.jit
    def combine_splits(part_ptr, lse_ptr, out_ptr, b, heads, h_mask, n_used, num_heads, stride_ob, stride_oh,
                       NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_S: tl.constexpr, INTERPRETED: tl.constexpr):
        """Sequence ``b``'s attention output for query ``heads`` (``h_mask``: the real ones) from the partial outputs
        and log-sum-exps of its first ``n_used`` splits, weighted by ``exp2(lse - max)``, ``CHUNK`` splits a step:
        what the combine kernel of :mod:`~llmplug.ops.decode_attention` does for one head, here for a kv head's query
        heads in the split that finished last. Reads past L1 (``.cg``): other programs wrote these."""
        CHUNK: tl.constexpr = 4  # (heads, CHUNK, BLOCK_D) partials in registers at a time
        offs_d = tl.arange(0, BLOCK_D)
        offs_s = tl.arange(0, BLOCK_S)
        rows = (b * num_heads + heads).to(tl.int64) * NUM_SPLITS  # (BLOCK_H,) each head's split 0
        lse = tl.load(lse_ptr + rows[:, None] + offs_s[None, :], mask=h_mask[:, None] & (offs_s < n_used)[None, :],
                      other=float("-inf"), cache_modifier=".cg")
        m = tl.max(lse, 1)
        m = tl.where(m > float("-inf"), m, 0.0)
        total = tl.sum(tl.where(lse > float("-inf"), tl.exp2(lse - m[:, None]), 0.0), 1)
        acc = tl.zeros([heads.shape[0], BLOCK_D], dtype=tl.float32)
        offs_c = tl.arange(0, CHUNK)
        for c in range(0, n_used, CHUNK):
            s_mask = h_mask[:, None] & ((c + offs_c) < n_used)[None, :]  # (BLOCK_H, CHUNK)
            lse_c = tl.load(lse_ptr + rows[:, None] + c + offs_c[None, :], mask=s_mask, other=float("-inf"),
                            cache_modifier=".cg")
            w = tl.where(lse_c > float("-inf"), tl.exp2(lse_c - m[:, None]), 0.0)
            # every split below n_used wrote its partial (zeros where lse is -inf): no wait on lse for this load
            part = tl.load(part_ptr + (rows[:, None] + c + offs_c[None, :])[:, :, None] * HEAD_DIM
                           + offs_d[None, None, :], mask=s_mask[:, :, None] & (offs_d < HEAD_DIM)[None, None, :],
                           other=0.0, cache_modifier=".cg")
            acc += tl.sum(part * w[:, :, None], 1)
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        if INTERPRETED:
            out = round_rne(out, out_ptr.dtype.element_ty)
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & (offs_d < HEAD_DIM)[None, :])


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_SMS


def tile_config(head_dim: int, elem_size: int, cache_elem_size: int, programs: int,
                gpu: str = "") -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` for a (padded) head dim, the query's and cache's element sizes, the
    launch's (sequence, kv head) programs before splitting and the GPU's name (:func:`gpu_name`)."""
    # NOTE: a K or V tile <= 16 KiB; sizes from H100 timings, 2026-11-22/27 (BENCHMARKS.md, "Figures moved from code")
    if elem_size >= 4:
        return 16, 4, 3
    if cache_elem_size == 1:
        return (128 if head_dim <= 128 else 64), 4, 3
    if head_dim <= 64 and "H200" in gpu:
        # NOTE: an H200's faster memory wants more bytes in flight a program (H200, 2026-12-02; BENCHMARKS.md,
        # "Decode attention tiles on an H200"); a GH200's name matches too, unmeasured there
        if programs >= 1024:
            return 64, 4, 2
        if programs >= 256:
            return 128, 4, 3
    elif head_dim <= 64 and programs >= 1024:
        return 32, 4, 3
    return (64 if head_dim <= 128 else 32), 4, 3


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def gpu_name(device: torch.device) -> str:
    """The CUDA device's name (``""`` off CUDA): :func:`tile_config` tiles some GPUs apart."""
    if device.type == "cuda":
        return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())
    return ""


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int,
                      min_tiles: int = MIN_TILES_PER_SPLIT) -> int:
    """Flash-decoding split count from static quantities only (CUDA-graph safe: never from ``seq_lens`` values).

    Aims for about two programs per SM (``batch * num_kv_heads * splits >= 2 * num_sms``), but gives every split at
    least ``min_tiles`` tiles of the longest possible context, and caps at ``MAX_SPLITS``; rounded down
    to a power of two. E.g. on 132 SMs with 8 kv heads and 8k context in 64-token tiles: batch 1 -> 32 splits,
    batch 8 -> 4, batch 64 -> 1.
    """
    # NOTE: guesses, untuned; 1 split won at batch 128-256 (H100, 2026-11-27; BENCHMARKS.md, "Decode attention tiles")
    want = triton.cdiv(2 * num_sms, max(1, batch * num_kv_heads))
    cap = max(1, triton.cdiv(max_context, block_n) // min_tiles)
    splits = max(1, min(want, cap, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)  # a power of two: the split count is a kernel constant, so few compiles
