"""Prefill attention over a paged KV cache: packed variable-length queries, cached context plus causal new tokens.

``B`` sequences are packed without padding. Sequence ``b`` contributes the query rows
``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of ``q``; the matching rows of ``k``/``v`` are its new keys/values. Before
this step, ``context_lens[b]`` tokens of the sequence are already in the paged cache (0 for a fresh prompt, > 0 for
chunked prefill or prefix reuse), so new token ``j`` sits at absolute position ``context_lens[b] + j``. Each query
attends to every cached token of its sequence (read through ``block_tables``) and causally to the new tokens (read
from the contiguous ``k``/``v``; the caller writes them into the cache separately, and this op never reads them
from there). Optional sliding window (HF convention: a query sees ``sliding_window`` keys including itself) and
logit soft-capping (Gemma 2/3).

Paged layout: ``k_cache, v_cache: (num_blocks, P, Hkv, D)``; the ``i``-th cached token of sequence ``b`` lives in block
``block_tables[b, i // P]`` at offset ``i % P``. An fp8/int8 cache comes with ``k_scale, v_scale: (num_blocks, Hkv, P)``
fp32: the kernel converts the cached tiles to the query dtype in registers, multiplies each token's K scale into its
score column and its V scale into its probability column (fp16, whose range ``p * v_scale`` could underflow: into the
V rows). The new tokens' k/v are read as given, unquantized.
"""

from __future__ import annotations

import math

import torch

from ._triton import call_op, check_out, llmplug_op, maybe_wrap, next_pow2, round_rne, tl, triton, use_triton
from .kv_quant import check_scales, is_quantized, read_pages_ref

MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
TILE_FIELDS = 5  # int32 fields of a tile map row (see :func:`_tile_map`)


def prefill_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference (and CPU path): per sequence, gather the cached k/v from the pages (dequantized when ``k_scale,
    v_scale`` are given), append the new k/v, mask, softmax.

    Math in fp32 (fp64 for fp64 inputs); the result is rounded to ``q.dtype`` once. Shapes as in
    :func:`prefill_attention`; ``max_seqlen_q`` is unused here.
    """
    del max_seqlen_q
    t, h, d = q.shape
    hkv, page = k.shape[1], k_cache.shape[1]
    group = h // hkv
    cdt = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    cu, ctx_lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for b in range(len(ctx_lens)):
        s, e, ctx = cu[b], cu[b + 1], ctx_lens[b]
        n_new = e - s
        if n_new == 0:
            continue
        idx = torch.arange(ctx, device=q.device)
        blocks, offsets = block_tables[b, idx // page].long(), idx % page
        kk = torch.cat([read_pages_ref(k_cache, k_scale, blocks, offsets, cdt).to(cdt), k[s:e].to(cdt)])
        vv = torch.cat([read_pages_ref(v_cache, v_scale, blocks, offsets, cdt).to(cdt), v[s:e].to(cdt)])
        kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)  # (L, H, D)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].to(cdt), kk) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = ctx + torch.arange(n_new, device=q.device)[:, None]
        k_pos = torch.arange(ctx + n_new, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window > 0:
            allowed &= k_pos > q_pos - sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)
    return out


if triton is not None:
    _TILE_FIELDS = tl.constexpr(TILE_FIELDS)

    @triton.jit
    def _tile_range(need_lo, need_hi, safe_lo, safe_hi, BLOCK_N: tl.constexpr):
        """Split the key tiles covering ``[need_lo, need_hi)`` into masked / unmasked / masked runs.

        Positions are relative to the phase's first key (so all >= 0). A tile is unmasked when all its keys lie in
        ``[safe_lo, safe_hi)``, the keys every query of the tile may see. Returns tile indices
        ``lo <= mid_lo <= mid_hi <= hi``: masked ``[lo, mid_lo)``, unmasked ``[mid_lo, mid_hi)``, masked
        ``[mid_hi, hi)``.
        """
        lo = need_lo // BLOCK_N
        hi = (need_hi + BLOCK_N - 1) // BLOCK_N
        mid_lo = (tl.maximum(safe_lo, 0) + BLOCK_N - 1) // BLOCK_N
        mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
        mid_hi = tl.maximum(safe_hi, 0) // BLOCK_N
        mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
        return lo, mid_lo, mid_hi, hi

    @triton.jit
    def _attend_tiles(
        acc, m_i, l_i, q, q_pos, k_base, v_base, bt_row_ptr, stride_k_blk, stride_k_row, stride_v_blk, stride_v_row,
        ks_base, vs_base, stride_s_blk, tile_lo, tile_hi, key_start, key_end, scale, softcap, window, offs_n, offs_d,
        PAGED: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr, SCALE_P: tl.constexpr,
    ):
        """Online-softmax update of ``(acc, m_i, l_i)`` with key tiles ``[tile_lo, tile_hi)`` of one phase.

        Scores live in the log2 domain (``exp2``). ``PAGED``: keys come from the paged cache (phase-relative position
        = cache index); otherwise from the contiguous new k/v rows at ``k_base``. ``MASKED``: apply the bounds, causal
        and window masks (only the tiles at the edges of the visible range need it). ``QUANT`` (paged only): fp8/int8
        tiles with per-token scales at ``ks_base``/``vs_base``; ``SCALE_P``: V scales go into p, else into V (fp16).
        """
        for tile in range(tile_lo, tile_hi):
            n = tile * BLOCK_N + offs_n  # phase-relative key index
            if PAGED:
                if MASKED:
                    blk = tl.load(bt_row_ptr + n // PAGE, mask=n < key_end, other=0)
                else:
                    blk = tl.load(bt_row_ptr + n // PAGE)
                blk = blk.to(tl.int64)
                k_rows = blk * stride_k_blk + (n % PAGE) * stride_k_row
                v_rows = blk * stride_v_blk + (n % PAGE) * stride_v_row
            else:
                k_rows = n.to(tl.int64) * stride_k_row
                v_rows = n.to(tl.int64) * stride_v_row
            k_ptrs = k_base + k_rows[:, None] + offs_d[None, :]
            v_ptrs = v_base + v_rows[:, None] + offs_d[None, :]
            k_pos = key_start + n  # absolute position
            if MASKED:
                ld_mask = (k_pos < key_end)[:, None]
                if BLOCK_D != HEAD_DIM:
                    ld_mask = ld_mask & (offs_d < HEAD_DIM)[None, :]
                kt = tl.load(k_ptrs, mask=ld_mask, other=0.0)
                vt = tl.load(v_ptrs, mask=ld_mask, other=0.0)
            elif BLOCK_D != HEAD_DIM:
                kt = tl.load(k_ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
                vt = tl.load(v_ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
            else:
                kt = tl.load(k_ptrs)
                vt = tl.load(v_ptrs)
            if QUANT:
                s_rows = blk * stride_s_blk + n % PAGE
                if MASKED:
                    k_scale = tl.load(ks_base + s_rows, mask=k_pos < key_end, other=0.0)
                    v_scale = tl.load(vs_base + s_rows, mask=k_pos < key_end, other=0.0)
                else:
                    k_scale = tl.load(ks_base + s_rows)
                    v_scale = tl.load(vs_base + s_rows)
                if not SCALE_P:
                    vt = vt.to(tl.float32) * v_scale[:, None]
            kt = kt.to(q.dtype)  # no-ops unless upcast (q is fp32 then) or quantized
            vt = vt.to(q.dtype)

            s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N) fp32
            if QUANT:
                s = s * k_scale[None, :]
            if HAS_SOFTCAP:
                # softcap * tanh(scale * s / softcap), then to the log2 domain; tanh(x) = sign(x) (1 - e) / (1 + e)
                # with e = exp(-2|x|) in (0, 1] (no overflow).
                x = s * (scale / softcap)
                e = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
                th = (1.0 - e) / (1.0 + e)
                s = tl.where(x < 0, -th, th) * (softcap * 1.4426950408889634)
            else:
                s = s * (scale * 1.4426950408889634)
            if MASKED:
                allowed = (k_pos[None, :] < key_end) & (k_pos[None, :] <= q_pos[:, None])
                if HAS_WINDOW:
                    allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
                s = tl.where(allowed, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if QUANT and SCALE_P:
                p = p * v_scale[None, :]
            if UPCAST:
                p = round_rne(p, tl.bfloat16)
            acc = tl.dot(p.to(vt.dtype), vt, acc, input_precision=DOT_PREC)  # p rounded to v's dtype
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit(do_not_specialize=["num_seqs", "max_tiles"])  # one compile for any count
    def _tile_map_kernel(cu_q_ptr, ctx_ptr, tiles_ptr, count_ptr, num_seqs, max_tiles, BLOCK_M: tl.constexpr,
                         BLOCK: tl.constexpr, SORT: tl.constexpr):
        # One program. Rows run over the sequences last to first, each sequence's tiles last to first (its last, most
        # causal keys, tiles start earliest); count_ptr gets the number of tiles. Where any sequence has cached context
        # and SORT (a power of two >= the rows) is set, the rows are then reordered by keys attended, most first.
        total = 0
        max_ctx = 0
        for s0 in range(0, num_seqs, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            live = s < num_seqs
            q_len = tl.load(cu_q_ptr + s + 1, mask=live, other=0) - tl.load(cu_q_ptr + s, mask=live, other=0)
            total += tl.sum((q_len + BLOCK_M - 1) // BLOCK_M, 0)
        before = 0
        for s0 in range(0, num_seqs, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            live = s < num_seqs
            q_start = tl.load(cu_q_ptr + s, mask=live, other=0)
            q_len = tl.load(cu_q_ptr + s + 1, mask=live, other=0) - q_start
            ctx = tl.load(ctx_ptr + s, mask=live, other=0)
            max_ctx = tl.maximum(max_ctx, tl.max(ctx, 0))
            n_tiles = (q_len + BLOCK_M - 1) // BLOCK_M
            first = total - 1 - (before + tl.cumsum(n_tiles, 0) - n_tiles)  # the row of the sequence's first tile
            for j in range(0, max_tiles):
                row = tiles_ptr + (first - j) * _TILE_FIELDS
                has = j < n_tiles
                tl.store(row, s, mask=has)
                tl.store(row + 1, q_start, mask=has)
                tl.store(row + 2, q_len, mask=has)
                tl.store(row + 3, j * BLOCK_M + tl.zeros_like(s), mask=has)
                tl.store(row + 4, ctx, mask=has)
            before += tl.sum(n_tiles, 0)
        tl.store(count_ptr, total)
        if SORT > 0:  # a constexpr: whether the rows fit one block
            if max_ctx > 0:  # longest job first; without context the order above was as fast (and free)
                tl.debug_barrier()
                r = tl.arange(0, SORT)
                live = r < total
                rows = tiles_ptr + r * _TILE_FIELDS
                q_len = tl.load(rows + 2, mask=live, other=0)
                start_m = tl.load(rows + 3, mask=live, other=0)
                work = tl.load(rows + 4, mask=live, other=0) + tl.minimum(start_m + BLOCK_M, q_len)
                key = tl.where(live, work.to(tl.int64) * SORT + (SORT - 1 - r), -1)
                order = SORT - 1 - (tl.sort(key, descending=True) % SORT).to(tl.int32)
                src = tiles_ptr + order * _TILE_FIELDS
                f0 = tl.load(src, mask=live, other=0)
                f1 = tl.load(src + 1, mask=live, other=0)
                f2 = tl.load(src + 2, mask=live, other=0)
                f3 = tl.load(src + 3, mask=live, other=0)
                f4 = tl.load(src + 4, mask=live, other=0)
                tl.debug_barrier()
                tl.store(rows, f0, mask=live)
                tl.store(rows + 1, f1, mask=live)
                tl.store(rows + 2, f2, mask=live)
                tl.store(rows + 3, f3, mask=live)
                tl.store(rows + 4, f4, mask=live)

    @triton.jit
    def _prefill_attention_kernel(
        q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, tiles_ptr, count_ptr, out_ptr, stride_qt,
        stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_kcb, stride_kcp, stride_kch, stride_vcb,
        stride_vcp, stride_vch, stride_scb, stride_sch, stride_bt, stride_ot, stride_oh, scale, softcap, window,
        GROUP: tl.constexpr, PACK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr, SCALE_P: tl.constexpr,
    ):
        # grid = (H // PACK, rows of the tile map): program (j, i) runs map row i's tile of BLOCK_M // PACK queries
        # (:func:`_tile_map`) for the PACK query heads j * PACK ... that share one kv head, as BLOCK_M rows
        # (query-major: row r is query r // PACK of head j * PACK + r % PACK), so each K/V tile serves PACK heads
        # and the causal diagonal spans BLOCK_M // PACK keys. Heads vary fastest so the programs sharing a kv head
        # run side by side (L2 reuse of K/V). The programs past the tile count, all at the grid's end, exit after
        # one load.
        h0 = tl.program_id(0) * PACK
        i = tl.program_id(1)
        if i >= tl.load(count_ptr):
            return
        row = tiles_ptr + i * _TILE_FIELDS
        b = tl.load(row)
        q_start = tl.load(row + 1)
        q_len = tl.load(row + 2)
        start_m = tl.load(row + 3)
        ctx = tl.load(row + 4)
        # Inductor passes Python floats as fp64 (eager Triton as fp32): pin them, or the scores turn fp64.
        scale = tl.cast(scale, tl.float32)
        softcap = tl.cast(softcap, tl.float32)
        hkv = h0 // GROUP

        r = tl.arange(0, BLOCK_M)
        offs_m = start_m + r // PACK  # each row's query (chunk-relative)
        heads = h0 + r % PACK  # each row's query head
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        rows = (q_start + offs_m).to(tl.int64)
        q_mask = (offs_m < q_len)[:, None]
        if BLOCK_D != HEAD_DIM:
            q_mask = q_mask & (offs_d < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask,
                    other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        q_pos = ctx + offs_m  # absolute positions of this tile's queries
        last_m = tl.minimum(start_m + BLOCK_M // PACK, q_len) - 1  # last real query of the tile (chunk-relative)

        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: fully masked tiles give exp2(-inf) = 0, not NaN
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)

        # Phase 1: cached context, keys at absolute positions [0, ctx) read from the pages. All precede every query,
        # so only the sliding window and the ragged last tile need masks.
        need_lo = 0
        safe_lo = 0
        if HAS_WINDOW:
            need_lo = tl.maximum(ctx + start_m - window + 1, 0)
            safe_lo = ctx + last_m - window + 1
        lo, mid_lo, mid_hi, hi = _tile_range(need_lo, ctx, safe_lo, ctx, BLOCK_N)
        kc_base = kc_ptr + hkv * stride_kch
        vc_base = vc_ptr + hkv * stride_vch
        ks_base = ks_ptr + hkv * stride_sch
        vs_base = vs_ptr + hkv * stride_sch
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, kc_base, vc_base, bt_row, stride_kcb, stride_kcp, stride_vcb, stride_vcp,
            ks_base, vs_base, stride_scb, lo, mid_lo, 0, ctx, scale, softcap, window, offs_n, offs_d,
            True, True, HAS_WINDOW, HAS_SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, DOT_PREC, UPCAST, QUANT, SCALE_P,
        )  # fmt: skip
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, kc_base, vc_base, bt_row, stride_kcb, stride_kcp, stride_vcb, stride_vcp,
            ks_base, vs_base, stride_scb, mid_lo, mid_hi, 0, ctx, scale, softcap, window, offs_n, offs_d,
            True, False, HAS_WINDOW, HAS_SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, DOT_PREC, UPCAST, QUANT, SCALE_P,
        )  # fmt: skip
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, kc_base, vc_base, bt_row, stride_kcb, stride_kcp, stride_vcb, stride_vcp,
            ks_base, vs_base, stride_scb, mid_hi, hi, 0, ctx, scale, softcap, window, offs_n, offs_d,
            True, True, HAS_WINDOW, HAS_SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, DOT_PREC, UPCAST, QUANT, SCALE_P,
        )  # fmt: skip

        # Phase 2: this step's new tokens, chunk-relative keys [0, last_m] from the contiguous k/v. Tiles entirely
        # below the tile's first query (and inside every query's window) run unmasked; the diagonal ones are masked.
        need_lo = 0
        safe_lo = 0
        if HAS_WINDOW:
            need_lo = tl.maximum(start_m - window + 1, 0)
            safe_lo = last_m - window + 1
        lo, mid_lo, mid_hi, hi = _tile_range(need_lo, last_m + 1, safe_lo, start_m + 1, BLOCK_N)
        k_base = k_ptr + q_start.to(tl.int64) * stride_kt + hkv * stride_kh
        v_base = v_ptr + q_start.to(tl.int64) * stride_vt + hkv * stride_vh
        key_end = ctx + q_len
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, k_base, v_base, bt_row, 0, stride_kt, 0, stride_vt,
            k_base, v_base, 0, lo, mid_lo, ctx, key_end, scale, softcap, window, offs_n, offs_d,
            False, True, HAS_WINDOW, HAS_SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, DOT_PREC, UPCAST, False, False,
        )  # fmt: skip
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, k_base, v_base, bt_row, 0, stride_kt, 0, stride_vt,
            k_base, v_base, 0, mid_lo, mid_hi, ctx, key_end, scale, softcap, window, offs_n, offs_d,
            False, False, HAS_WINDOW, HAS_SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, DOT_PREC, UPCAST, False, False,
        )  # fmt: skip
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, k_base, v_base, bt_row, 0, stride_kt, 0, stride_vt,
            k_base, v_base, 0, mid_hi, hi, ctx, key_end, scale, softcap, window, offs_n, offs_d,
            False, True, HAS_WINDOW, HAS_SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, DOT_PREC, UPCAST, False, False,
        )  # fmt: skip

        # Every real query sees at least itself (l_i > 0); padding rows may see nothing, and are not stored.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if UPCAST:
            out = round_rne(out, tl.bfloat16)
        o_mask = (offs_m < q_len)[:, None]
        if BLOCK_D != HEAD_DIM:
            o_mask = o_mask & (offs_d < HEAD_DIM)[None, :]
        o_ptrs = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)

def _launch_config(head_dim: int, dtype: torch.dtype, on_gpu: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a head dim and dtype.

    BLOCK_M counts a program's rows: ``BLOCK_M // pack`` queries of ``pack`` heads (:func:`_pack`).
    """
    # NOTE: H200 sweep with 4 heads a program (2026-12-04; BENCHMARKS.md, "Session of 2026-12-04"); D>128 untuned
    if not on_gpu:
        # Interpreter: small tiles so short test sequences still span several query/key tiles (and every loop
        # kind runs); BLOCK_N = 16 against pages of 8/16/32 covers tiles spanning several pages and part of one.
        return 32, 16, 4, 1
    if dtype == torch.float32:  # exact fp32 dots (no tensor cores): a correctness path, not a fast one
        return (32, 32, 4, 2) if head_dim > 128 else (32, 16, 4, 2)
    if head_dim <= 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 2


def _pack(group: int, block_m: int, on_gpu: bool) -> int:
    """Query heads a program takes together (see the kernel): the largest power of two that divides ``group`` (the
    query heads per kv head), leaving at least 16 queries a tile on the GPU (4 in the interpreter's small tiles)."""
    pack = group & -group
    return max(1, min(pack, block_m // (16 if on_gpu else 4)))


_MAP_BLOCK = 128  # sequences the map kernel takes at once
_SORT_ROWS = 1024  # maps of up to this many rows are sorted (where a sequence has context)
_SORT_MIN = 64  # the smallest sort: six kernel variants in all, each compiled at warm-up (compile_tile_maps)


def _sort_size(rows: int) -> int:
    """The map kernel's ``SORT`` for a map of ``rows`` rows: a power of two >= rows, or 0 (no sort) past _SORT_ROWS."""
    return max(_SORT_MIN, next_pow2(rows)) if rows <= _SORT_ROWS else 0


def _tile_queries(head_dim: int, group: int, dtype: torch.dtype, on_gpu: bool) -> int:
    """Queries a tile of the attention kernel covers (its map's ``block_m``): ``BLOCK_M // pack``."""
    block_m = _launch_config(head_dim, dtype, on_gpu)[0]
    return block_m // _pack(group, block_m, on_gpu)


def compile_tile_maps(head_dim: int, group: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile now every variant of the map kernel that prefill steps of this attention shape may pick, one per sort
    size (a variant first met mid-serving compiled for 1.76 s on an H100, BENCHMARKS.md "Sessions of 2026-12-05 and
    2026-12-06").

    ``group``: query heads per kv head. Each map is of one empty sequence (it lists no tile), ``rows`` rows long.
    """
    q_block = _tile_queries(head_dim, group, dtype, device.type == "cuda")
    cu, ctx = torch.zeros(2, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device)
    sorted_rows = [_SORT_MIN << i for i in range((_SORT_ROWS // _SORT_MIN).bit_length())]  # 64, 128, ..., 1024
    for rows in [*sorted_rows, 2 * _SORT_ROWS]:  # the last one unsorted
        _tile_map(cu, ctx, rows * q_block, rows * q_block, q_block)


def _tile_map(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, num_tokens: int,
              max_seqlen_q: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention kernel's query tiles, listed on the device by one small kernel (no host sync, sizes from static
    shapes only: CUDA-graph safe) -> ``(tiles, count)``.

    ``tiles``: ``(S, TILE_FIELDS)`` int32, its first ``count[0]`` rows one per query tile ``(b, cu_seqlens_q[b], new
    tokens of b, the tile's first query, context_lens[b])``; ``S = min(T // BLOCK_M + B, B * cdiv(max_seqlen_q,
    BLOCK_M))`` bounds the tile count. Each attention program reads its row with one round of loads (finding its
    sequence by bisection over ``cu_seqlens_q`` was a chain of dependent loads as long as ``log2 B``), and the
    programs without a tile (a captured step's padding sequences, the room the bound leaves) all come last.

    Rows come sequences last to first, a sequence's tiles last to first; where any sequence has cached context (and
    ``S <= _SORT_ROWS``) they are reordered by keys attended (``context + min(first query + BLOCK_M, new tokens)``),
    most first, ties in that order, so the longest programs start first.
    NOTE: H200, 1B Engine (a) 68.9 -> 69.7% of the floor, (c) 69.3 -> 70.6; the sort (c) +1.5
    (BENCHMARKS.md, "The prefill tile map").
    """
    batch = context_lens.shape[0]
    max_tiles = triton.cdiv(max_seqlen_q, block_m)
    rows = min(num_tokens // block_m + batch, batch * max_tiles)
    tiles = torch.empty((rows, TILE_FIELDS), dtype=torch.int32, device=cu_seqlens_q.device)
    count = torch.empty(1, dtype=torch.int32, device=cu_seqlens_q.device)
    maybe_wrap(_tile_map_kernel)[(1,)](cu_seqlens_q, context_lens, tiles, count, batch, max_tiles, BLOCK_M=block_m,
                                       BLOCK=_MAP_BLOCK, SORT=_sort_size(rows), num_warps=8)
    return tiles, count


@llmplug_op("prefill_attention", mutates_args=("out",))
def _prefill_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    sliding_window: int,
    softcap: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if not use_triton(q):
        ref = prefill_attention_ref(q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                                    scale, sliding_window, softcap, k_scale, v_scale)
        lo, hi = int(cu_seqlens_q[0]), int(cu_seqlens_q[-1])  # the rows the sequences own; the rest stay as they are
        out[lo:hi].copy_(ref[lo:hi])
        return
    t, h, d = q.shape
    hkv, page = k.shape[1], k_cache.shape[1]
    batch = context_lens.shape[0]
    if t == 0 or batch == 0 or max_seqlen_q <= 0:
        return
    on_gpu = q.device.type == "cuda"
    block_m, block_n, num_warps, num_stages = _launch_config(d, q.dtype, on_gpu)
    pack = _pack(h // hkv, block_m, on_gpu)
    tiles, count = _tile_map(cu_seqlens_q, context_lens, t, max_seqlen_q, block_m // pack)
    quant = k_scale is not None
    maybe_wrap(_prefill_attention_kernel)[(h // pack, tiles.shape[0])](
        q, k, v, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache,  # placeholders
        block_tables, tiles, count, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0) if quant else 0, k_scale.stride(1) if quant else 0,
        block_tables.stride(0), out.stride(0), out.stride(1),
        float(scale), float(softcap) if softcap > 0 else 1.0, int(sliding_window) if sliding_window > 0 else 1,
        GROUP=h // hkv, PACK=pack, HEAD_DIM=d, BLOCK_D=next_pow2(d), BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page,
        HAS_WINDOW=sliding_window > 0, HAS_SOFTCAP=softcap > 0, QUANT=quant, SCALE_P=q.dtype != torch.float16,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        # The interpreter mishandles bf16 (numpy has none): its tl.dot multiplies the raw bits and its casts truncate.
        # So there the dots get fp32 operands, with p and the output rounded to bf16 values as the GPU would.
        UPCAST=q.device.type == "cpu" and q.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


@_prefill_attention_op.register_fake
def _(q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, scale, sliding_window, softcap,
      out, k_scale=None, v_scale=None):
    return None


def _check_inputs(q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, sliding_window, softcap,
                  k_scale, v_scale):
    for name, x, ndim in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if x.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
        if x.dtype != q.dtype and not (ndim == 4 and is_quantized(x.dtype) and v_cache.dtype == k_cache.dtype):
            raise ValueError(f"{name}.dtype={x.dtype} does not match q.dtype={q.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride on its last dim, got strides {x.stride()}")
    if q.dtype not in DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {DTYPES}")
    t, h, d = q.shape
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is not supported; use 1..{MAX_HEAD_DIM}")
    hkv = k.shape[1]
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"num query heads {h} is not divisible by num kv heads {hkv}")
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != (t, hkv, d):
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected (T, Hkv, D) = {(t, hkv, d)}")
    if k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} must both be "
            f"(num_blocks, P, Hkv={hkv}, D={d})"
        )
    if k_cache.shape[1] < 1:
        raise ValueError(f"page size {k_cache.shape[1]} must be >= 1")
    check_scales(k_cache, v_cache, k_scale, v_scale)
    for name, x, ndim in (("block_tables", block_tables, 2), ("cu_seqlens_q", cu_seqlens_q, 1),
                          ("context_lens", context_lens, 1)):  # fmt: skip
        if x.dtype != torch.int32 or x.dim() != ndim:
            raise ValueError(f"{name} must be a {ndim}-D int32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    batch = context_lens.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, expected B + 1 = {batch + 1}")
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, expected B = {batch}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables needs a unit stride on its last dim, got strides {block_tables.stride()}")
    if sliding_window == 0 or sliding_window < -1:
        raise ValueError(f"sliding_window={sliding_window} must be -1 (no window) or > 0")
    if not softcap >= 0:
        raise ValueError(f"softcap={softcap} must be >= 0 (0 = no soft-capping)")


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequence's paged cached context plus the new tokens.

    Args:
        q: ``(T, H, D)`` queries of this step's new tokens, all sequences packed; bf16/fp16/fp32. Any strides on
            dims 0 and 1 (e.g. a view into a fused qkv tensor), unit stride on the last dim. D in 64/80/96/128/256.
        k: ``(T, Hkv, D)`` new keys, same dtype and stride rules; ``H`` must be a multiple of ``Hkv`` (GQA/MQA:
            query head ``h`` uses kv head ``h // (H // Hkv)``).
        v: ``(T, Hkv, D)`` new values.
        k_cache: ``(num_blocks, P, Hkv, D)`` paged key cache holding each sequence's ``context_lens[b]`` earlier
            tokens, in ``q.dtype`` or fp8 e4m3 / int8. The new k/v need not be in it.
        v_cache: ``(num_blocks, P, Hkv, D)`` paged value cache, dtype of ``k_cache``.
        block_tables: ``(B, M)`` int32; cached token ``i`` of sequence ``b`` is in block ``block_tables[b, i // P]``
            at offset ``i % P``. Entries past a sequence's used blocks are never read.
        cu_seqlens_q: ``(B + 1,)`` int32 non-decreasing row offsets: sequence ``b`` owns rows
            ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of q/k/v (zero-length sequences allowed). The first need not be
            0: rows outside ``cu_seqlens_q[0] : cu_seqlens_q[B]`` are neither read nor written (in ``out`` either).
        context_lens: ``(B,)`` int32 number of tokens of each sequence already in the cache (0 for a fresh prompt);
            new token ``j`` of sequence ``b`` has absolute position ``context_lens[b] + j``.
        max_seqlen_q: python int >= the largest new-token count (bounds the launch grid).
        scale: softmax scale multiplied into ``q @ k^T`` (usually ``D ** -0.5``).
        sliding_window: -1 for none; else a query at position ``p`` sees keys at positions ``> p - sliding_window``.
        softcap: 0 for none; else scores become ``softcap * tanh(scores / softcap)`` (after scaling, before masking).
        k_scale, v_scale: ``(num_blocks, Hkv, P)`` fp32 scales of an fp8/int8 cache (cached tokens read as
            ``value * scale``, :mod:`llmplug.ops.kv_quant`); None for a cache in ``q.dtype``.
        out: ``(T, H, D)`` in ``q.dtype`` to write the result into (e.g. rows of a larger buffer; unit stride on the
            last dim); None returns a new tensor.

    Returns:
        ``(T, H, D)`` in ``q.dtype`` (accumulated in fp32): ``out``, or a new contiguous tensor.
    """
    _check_inputs(q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, sliding_window, softcap,
                  k_scale, v_scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale={scale} must be finite")
    if out is None:
        out = q.new_empty(q.shape)
    else:
        check_out(out, q)
    call_op(_prefill_attention_op, q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
            int(max_seqlen_q), float(scale), int(sliding_window), float(softcap), out, k_scale, v_scale)
    return out
