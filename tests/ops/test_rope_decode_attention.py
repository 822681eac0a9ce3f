import pytest
import torch

from llmplug.ops.decode_attention import decode_attention_ref
from llmplug.ops.rope_decode_attention import rope_decode_attention, rope_decode_attention_ref
from llmplug.ops.rope_store_kv import rope_store_kv_ref
from tests.ops.test_decode_attention import _paged, _quantized
from tests.ops.test_kv_quant import KV_DTYPES, bits
from tests.ops.test_rope_store_kv import _cos_sin
from tests.tolerances import assert_close_elementwise, assert_close_matmul_like


def _step(lens, num_heads, num_kv_heads, head_dim, page, dtype, window, rotary):
    """Decode-step inputs: poisoned pages (:func:`_paged`) whose newest position, the one this step stores, is NaN
    as well (the kernel must take it from ``k, v``); ``q, k, v`` views of one fused projection output; each
    sequence's new slot from its block table (-1 for padding rows)."""
    _, k_cache, v_cache, block_tables, seq_lens = _paged(lens, num_heads, num_kv_heads, head_dim, page, dtype, window)
    bsz, h, hkv, d = len(lens), num_heads, num_kv_heads, head_dim
    qkv = torch.randn(bsz, (h + 2 * hkv) * d).to(dtype)
    q = qkv[:, : h * d].view(bsz, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(bsz, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(bsz, hkv, d)
    slots = torch.full((bsz,), -1, dtype=torch.int64)
    for b, n in enumerate(lens):
        if n > 0:
            blk, off = block_tables[b, (n - 1) // page].item(), (n - 1) % page
            slots[b] = blk * page + off
            k_cache[blk, off] = v_cache[blk, off] = float("nan")
    cos, sin = _cos_sin(bsz, rotary, dtype)
    return qkv, (q, k, v, cos, sin), k_cache, v_cache, slots, block_tables, seq_lens


def _check(qkv, qkv_in, caches, slots, block_tables, seq_lens, window, softcap, splits, scales=(), counters=False):
    """The op against RoPE + store then attention; with ``counters`` the last split combines (and the counters are
    zeros again afterwards)."""
    q, k, v, cos, sin = qkv_in
    split_counters = torch.zeros(k.shape[0] * k.shape[1] + 3, dtype=torch.int32) if counters else None
    scale, before = q.shape[-1] ** -0.5, qkv.clone()
    want_caches = [c.clone() for c in (*caches, *scales)]
    quant = bool(scales)
    scale_kw = dict(k_scale=scales[0], v_scale=scales[1]) if quant else {}
    out = rope_decode_attention(q, k, v, cos, sin, *caches, slots, block_tables, seq_lens, scale, window, softcap,
                                split_counters=split_counters, _num_splits=splits, **scale_kw)
    assert split_counters is None or not split_counters.any(), "split counters must be left zeros"
    # The reference, step by step: RoPE + store (q, k rotated in a copy), then attention in fp64 and in q.dtype.
    ref_qkv = [x.clone() for x in (q, k)]
    rope_store_kv_ref(*ref_qkv, v, cos, sin, *want_caches[:2], slots, *want_caches[2:])
    kw = dict(k_scale=want_caches[2], v_scale=want_caches[3]) if quant else {}
    pages64 = want_caches[:2] if quant else [c.double() for c in want_caches[:2]]
    ref64 = decode_attention_ref(ref_qkv[0].double(), *pages64, block_tables, seq_lens, scale, window, softcap, **kw)
    same = decode_attention_ref(ref_qkv[0], *want_caches[:2], block_tables, seq_lens, scale, window, softcap, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert_close_matmul_like(out, ref64, same)
    assert (out[seq_lens == 0] == 0).all(), "padding rows must be zeros"
    assert torch.equal(qkv, before), "q, k, v must be left as they are"
    for got, want in zip((*caches, *scales), want_caches, strict=True):
        if quant:  # pages and scales bit for bit (NaN-poisoned rows included)
            as_int = (lambda t: t.view(torch.int32)) if got.dtype == torch.float32 else bits  # noqa: E731
            assert torch.equal(as_int(got), as_int(want))
        else:
            assert torch.equal(got.isnan(), want.isnan())
            assert_close_elementwise(got.nan_to_num(), want.nan_to_num())


CASES = {
    # name: (seq_lens, H, Hkv, D, P, dtype, sliding_window, softcap, num_splits (0: heuristic), rotary dims)
    "mha-fp32-1split": ([1, 17, 100], 4, 4, 64, 16, torch.float32, -1, 0.0, 1, 64),
    "gqa4-bf16-splits": ([1, 17, 100], 8, 2, 128, 16, torch.bfloat16, -1, 0.0, 4, 128),
    "mqa8-d80-p8-padding-partial": ([33, 0, 100, 5, 64, 0, 17], 8, 1, 80, 8, torch.float16, -1, 0.0, 3, 32),
    "window-softcap-fp32": ([1, 17, 100, 25], 4, 1, 64, 16, torch.float32, 24, 5.0, 3, 64),
    "window1-bf16": ([1, 17, 64, 65], 4, 2, 64, 16, torch.bfloat16, 1, 0.0, 2, 64),
    "tile-edge-fp16-auto": ([64, 65, 129, 2], 8, 2, 128, 16, torch.float16, -1, 50.0, 0, 64),
}


@pytest.mark.parametrize("counters", [False, True], ids=["combine-kernel", "last-split-combines"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_rope_store_then_attention(case, counters):
    lens, h, hkv, d, page, dtype, window, softcap, splits, rotary = CASES[case]
    qkv, qkv_in, k_cache, v_cache, slots, block_tables, seq_lens = _step(lens, h, hkv, d, page, dtype, window, rotary)
    _check(qkv, qkv_in, (k_cache, v_cache), slots, block_tables, seq_lens, window, softcap, splits, counters=counters)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("case", ["gqa4-bf16-splits", "window-softcap-fp32", "tile-edge-fp16-auto"])
def test_quantized_cache(kv_dtype, case):
    lens, h, hkv, d, page, dtype, window, softcap, splits, rotary = CASES[case]
    qkv, qkv_in, k_cache, v_cache, slots, block_tables, seq_lens = _step(lens, h, hkv, d, page, dtype, window, rotary)
    kq, vq, ks, vs = _quantized(k_cache, v_cache, kv_dtype)
    _check(qkv, qkv_in, (kq, vq), slots, block_tables, seq_lens, window, softcap, splits, (ks, vs), counters=True)


def test_reference_is_rope_store_then_attention():
    """The op's own reference (its CPU path) is the two-step composition, leaving q/k/v alone."""
    qkv, (q, k, v, cos, sin), k_cache, v_cache, slots, block_tables, seq_lens = _step(
        [5, 30, 0], 4, 2, 32, 8, torch.float64, -1, 32)
    caches = [k_cache.clone(), v_cache.clone()]
    before = qkv.clone()
    out = rope_decode_attention_ref(q, k, v, cos, sin, *caches, slots, block_tables, seq_lens, 0.2)
    assert torch.equal(qkv, before)
    q2, k2 = q.clone(), k.clone()
    rope_store_kv_ref(q2, k2, v, cos, sin, k_cache, v_cache, slots)
    torch.testing.assert_close(out, decode_attention_ref(q2, k_cache, v_cache, block_tables, seq_lens, 0.2))
    assert torch.equal(caches[0].nan_to_num(), k_cache.nan_to_num())


def test_bad_inputs():
    qkv, (q, k, v, cos, sin), k_cache, v_cache, slots, block_tables, seq_lens = _step(
        [5, 9], 4, 2, 64, 16, torch.float32, -1, 64)
    args = (k_cache, v_cache, slots, block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="rotary dim R=63"):
        rope_decode_attention(q, k, v, cos[:, :63], sin[:, :63], *args)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        rope_decode_attention(q, k, v, cos, sin, k_cache, v_cache, slots.int(), *args[3:])
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        rope_decode_attention(q, k, v, cos, sin, *args[:4], seq_lens.long(), 0.125)
    with pytest.raises(ValueError, match="H=3"):
        rope_decode_attention(q[:, :3], k, v, cos, sin, *args)
    with pytest.raises(ValueError, match="rows contiguous"):
        rope_decode_attention(q, torch.cat([k, k], dim=-1)[..., :64], v, cos, sin, *args)
    with pytest.raises(ValueError, match="split_counters must be"):
        rope_decode_attention(q, k, v, cos, sin, *args, split_counters=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="unit stride"):
        rope_decode_attention(q, k, v, cos.t().contiguous().t(), sin.t().contiguous().t(), *args)


@pytest.mark.interpreter  # on CPU the op is opaque only under the interpreter (llmplug_op)
def test_opcheck():
    qkv, (q, k, v, cos, sin), k_cache, v_cache, slots, block_tables, seq_lens = _step(
        [3, 20], 4, 2, 64, 16, torch.float32, -1, 64)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    args = (q, k, v, cos, sin, k_cache, v_cache, slots, block_tables, seq_lens, 0.125, -1, 0.0, 2)
    torch.library.opcheck(torch.ops.llmplug.rope_decode_attention.default, args)
    counters = torch.zeros(8, dtype=torch.int32)
    torch.library.opcheck(torch.ops.llmplug.rope_decode_attention.default, args + (None, None, counters))
