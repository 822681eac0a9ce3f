import pytest
import torch
import torch.nn.functional as F

from llmplug.ops._triton import INTERPRET
from llmplug.ops.prefill_attention import prefill_attention, prefill_attention_ref
from llmplug.quant.formats import sqnr_db
from tests.ops.test_kv_quant import quantize_pages
from tests.tolerances import KV_CACHE_SQNR_DB, assert_close_matmul_like


def make_inputs(seqlens, ctx_lens, h, hkv, d, page, dtype, layout="fused", device="cpu"):
    """Packed new tokens plus a paged cache holding ``ctx_lens[b]`` earlier tokens of each sequence.

    ``layout="fused"``: q/k/v are views of one ``(T, (H + 2 Hkv) D)`` tensor; ``"strided_heads"``: every other head
    of wider tensors (dim-1 stride 2D). The cache is NaN except the slots holding context tokens, and block-table
    entries past a sequence's used blocks point at all-NaN blocks, so reading anything else poisons the output.
    """
    t = sum(seqlens)
    if layout == "fused":
        qkv = torch.randn(t, (h + 2 * hkv) * d).to(device, dtype)
        q = qkv[:, : h * d].view(t, h, d)
        k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
        v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
    else:
        q, k, v = (torch.randn(t, 2 * n, d).to(device, dtype)[:, ::2] for n in (h, hkv, hkv))
    used = [-(-c // page) for c in ctx_lens]
    width = max(used) + 1
    num_blocks = sum(used) + 2
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks)
    block_tables = torch.full((len(seqlens), width), int(perm[-1]), dtype=torch.int32)  # unused: an all-NaN block
    nxt = 0
    for b, (n, c) in enumerate(zip(used, ctx_lens, strict=True)):
        block_tables[b, :n] = perm[nxt : nxt + n]
        nxt += n
        idx = torch.arange(c)
        blk, off = block_tables[b, idx // page].long(), idx % page
        k_cache[blk, off] = torch.randn(c, hkv, d).to(device, dtype)
        v_cache[blk, off] = torch.randn(c, hkv, d).to(device, dtype)
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    return [q, k, v, k_cache, v_cache, block_tables.to(device), cu, ctx, max(seqlens)]


def to64(args):
    return [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (dtype, D, H, Hkv, P, new-token counts, context lengths, sliding_window, softcap, layout)
CASES = [
    pytest.param(F32, 64, 4, 4, 16, [1, 19, 37], [0, 0, 0], -1, 0.0, "fused", id="fresh-mha-d64-f32"),
    pytest.param(F16, 80, 4, 1, 16, [1, 19, 37], [0, 5, 33], -1, 0.0, "fused", id="ctx-gqa4-d80-f16"),
    pytest.param(BF16, 128, 8, 1, 8, [37, 1, 19], [33, 0, 5], -1, 0.0, "fused", id="ctx-gqa8-d128-p8-bf16"),
    pytest.param(BF16, 96, 4, 2, 32, [19, 0, 37], [40, 7, 3], 7, 0.0, "fused", id="window7-empty-seq-d96-p32-bf16"),
    pytest.param(F32, 256, 2, 1, 16, [70, 19], [5, 33], 24, 0.0, "strided_heads", id="window24-d256-strided-f32"),
    pytest.param(F16, 64, 4, 1, 16, [1, 19, 37], [0, 5, 33], -1, 30.0, "fused", id="softcap-gqa4-d64-f16"),
    pytest.param(BF16, 128, 4, 2, 16, [37, 19], [33, 0], 18, 50.0, "fused", id="window18-softcap-d128-bf16"),
    pytest.param(F32, 80, 4, 1, 16, [37], [70], 40, 10.0, "fused", id="window40-softcap-longctx-d80-f32"),
    pytest.param(BF16, 64, 12, 2, 16, [37, 5, 19], [0, 21, 3], -1, 0.0, "fused", id="gqa6-packs-2-heads-bf16"),
]


@pytest.mark.parametrize("dtype, d, h, hkv, page, seqlens, ctx_lens, window, softcap, layout", CASES)
def test_matches_reference(dtype, d, h, hkv, page, seqlens, ctx_lens, window, softcap, layout):
    args = make_inputs(seqlens, ctx_lens, h, hkv, d, page, dtype, layout)
    scale = d**-0.5
    out = prefill_attention(*args, scale, window, softcap)
    assert out.shape == args[0].shape and out.dtype == dtype and out.is_contiguous()
    ref64 = prefill_attention_ref(*to64(args), scale, window, softcap)
    assert_close_matmul_like(out, ref64, prefill_attention_ref(*args, scale, window, softcap))


def test_oversized_grid():
    """``max_seqlen_q`` above the longest sequence only adds idle programs."""
    args = make_inputs([5, 12], [3, 0], 2, 1, 64, 16, torch.float32)
    args[8] += 40
    out = prefill_attention(*args, 0.125)
    assert_close_matmul_like(out, prefill_attention_ref(*to64(args), 0.125), prefill_attention_ref(*args, 0.125))


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
def test_sequences_after_other_rows_and_padding_sequences(reference):
    """A captured packed step's layout: the sequences start at row 7 (rows before belong to others), zero-length
    padding sequences follow, and the grid is sized for more tokens than there are; each sequence gets what it gets
    alone, bit for bit, and rows outside the sequences keep their values."""
    from llmplug.ops._triton import cpu_kernels

    seqlens, ctx_lens = [19, 1, 37, 5], [5, 0, 33, 17]
    args = make_inputs(seqlens, ctx_lens, 4, 1, 64, 16, torch.bfloat16)
    q, k, v, kc, vc, tables, cu, ctx, _ = args
    t, lead, pads = q.shape[0], 7, 3

    def rows(x):  # other rows before and after
        other = torch.randn((lead + 9,) + x.shape[1:]).to(x.dtype)
        return torch.cat([other[:lead], x, other[lead:]])

    big_q, big_k, big_v = rows(q), rows(k), rows(v)
    big_cu = torch.cat([cu + lead, torch.full((pads,), t + lead, dtype=torch.int32)])
    big_ctx = torch.cat([ctx, torch.zeros(pads, dtype=torch.int32)])
    big_tables = torch.cat([tables, tables[:1].expand(pads, -1)])
    with cpu_kernels(INTERPRET and not reference):
        out = torch.full(big_q.shape, 3.0, dtype=torch.bfloat16)
        prefill_attention(big_q, big_k, big_v, kc, vc, big_tables, big_cu, big_ctx, big_q.shape[0], 0.125, out=out)
        for b, n in enumerate(seqlens):
            s = int(cu[b])
            alone = prefill_attention(q[s:s + n], k[s:s + n], v[s:s + n], kc, vc, tables[b:b + 1],
                                      torch.tensor([0, n], dtype=torch.int32), ctx[b:b + 1], n, 0.125)
            assert torch.equal(out[lead + s:lead + s + n], alone), f"sequence {b}"
    assert (out[:lead] == 3).all() and (out[lead + t:] == 3).all()


@pytest.mark.skipif(not INTERPRET, reason="the tile map kernel runs on CPU tensors only under the interpreter")
@pytest.mark.parametrize("block_m", [16, 32, 128])
def test_tile_map_lists_every_query_tile_once(block_m):
    """The rows the attention programs read: every query tile of every sequence exactly once (a sequence starting at
    row ``cu[0] > 0``, zero-length and padding sequences among them), then the count of them."""
    from llmplug.ops.prefill_attention import _tile_map

    seqlens, ctx_lens, lead = [19, 0, 37, 1, 64, 0, 0], [5, 9, 33, 0, 2, 0, 0], 7
    cu = torch.tensor([lead, *(lead + torch.tensor(seqlens).cumsum(0)).tolist()], dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    tiles, count = _tile_map(cu, ctx, lead + sum(seqlens) + 40, max(seqlens), block_m)
    want = sorted((b, int(cu[b]), n, m, c) for b, (n, c) in enumerate(zip(seqlens, ctx_lens))
                  for m in range(0, n, block_m))
    assert int(count) == len(want) <= tiles.shape[0]
    assert sorted(tuple(r) for r in tiles[:len(want)].tolist()) == want


@pytest.mark.skipif(not INTERPRET, reason="the tile map kernel runs on CPU tensors only under the interpreter")
@pytest.mark.parametrize("ctx_lens", [[0, 0, 0, 0, 0], [0, 40, 0, 3, 0]])
def test_tile_map_order(ctx_lens):
    """Without context the rows run sequences last to first, each one's tiles last to first; with context they run
    by keys attended (context + causal keys of the tile's last query), most first, ties in that same order."""
    from llmplug.ops.prefill_attention import _tile_map

    block_m, seqlens = 16, [40, 7, 33, 16, 0]
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    tiles, count = _tile_map(cu, torch.tensor(ctx_lens, dtype=torch.int32), sum(seqlens), max(seqlens), block_m)
    rows = [tuple(r) for r in tiles[:int(count)].tolist()]
    default = [(b, int(cu[b]), n, m, c) for b, (n, c) in reversed(list(enumerate(zip(seqlens, ctx_lens))))
               for m in reversed(range(0, n, block_m))]
    if any(ctx_lens):
        default.sort(key=lambda r: -(r[4] + min(r[3] + block_m, r[2])))  # stable: ties keep the default order
    assert rows == default


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels only: run with TRITON_INTERPRET=0")
@pytest.mark.parametrize("d, group, dtype", [(64, 4, torch.bfloat16), (128, 4, torch.bfloat16),
                                             (256, 2, torch.float16)])
def test_compile_tile_maps_leaves_no_variant_to_compile(d, group, dtype):
    """After ``compile_tile_maps`` a map of any size (sorted or not) is served from the kernel's cache."""
    from triton import knobs

    from llmplug.ops.prefill_attention import _tile_map, _tile_queries, compile_tile_maps

    compile_tile_maps(d, group, dtype, torch.device("cuda"))
    q_block = _tile_queries(d, group, dtype, True)
    misses, before = [], knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: misses.append(kw["repr"]) and False
    try:
        for batch in (1, 3, 40, 129, 700, 1500):
            cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_block
            ctx = torch.full((batch,), 5, dtype=torch.int32, device="cuda")
            _tile_map(cu, ctx, batch * q_block, q_block, q_block)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = before
    assert misses == []


def test_pack_takes_query_heads_of_one_kv_head():
    """A program takes the largest power of two of query heads that divides the group, keeping 16 queries a tile on
    the GPU (4 in the interpreter's 32-row tiles)."""
    from llmplug.ops.prefill_attention import _pack

    assert [_pack(g, 128, True) for g in (1, 2, 3, 4, 6, 8, 16)] == [1, 2, 1, 4, 2, 8, 8]
    assert [_pack(g, 32, False) for g in (4, 8, 16)] == [4, 8, 8]
    assert _pack(4, 16, True) == 1


def test_reference_matches_sdpa():
    """No cache, no window, no softcap: the reference is causal SDPA per sequence (with GQA)."""
    args = make_inputs([3, 17, 30], [0, 0, 0], 6, 2, 64, 16, torch.float64)
    q, k, v, cu = args[0], args[1], args[2], args[6].tolist()
    out = prefill_attention_ref(*args, 0.3)
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))
        expected = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[s:e], expected.transpose(0, 1))


@pytest.mark.parametrize("window, softcap", [(-1, 0.0), (9, 20.0)])
def test_context_equals_fresh_prompt(window, softcap):
    """Queries after ``c`` cached tokens match the last rows of the same tokens run as one fresh prompt."""
    c, n, h, hkv, d, page = 21, 11, 2, 1, 64, 8
    kk, vv = torch.randn(c + n, hkv, d, dtype=torch.float64), torch.randn(c + n, hkv, d, dtype=torch.float64)
    qq = torch.randn(c + n, h, d, dtype=torch.float64)
    k_cache = torch.zeros(8, page, hkv, d, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    blocks = torch.tensor([5, 2, 7], dtype=torch.int32)
    slots = blocks.long()[torch.arange(c) // page] * page + torch.arange(c) % page
    k_cache.view(-1, hkv, d)[slots], v_cache.view(-1, hkv, d)[slots] = kk[:c], vv[:c]
    bt = torch.stack([blocks, torch.zeros_like(blocks)])
    i32 = torch.int32
    fresh = prefill_attention_ref(
        qq, kk, vv, k_cache, v_cache, bt[1:], torch.tensor([0, c + n], dtype=i32), torch.tensor([0], dtype=i32),
        c + n, 0.2, window, softcap,
    )  # fmt: skip
    chunk_args = [qq[c:], kk[c:], vv[c:], k_cache, v_cache, bt[:1], torch.tensor([0, n], dtype=i32),
                  torch.tensor([c], dtype=i32), n]  # fmt: skip
    torch.testing.assert_close(prefill_attention_ref(*chunk_args, 0.2, window, softcap), fresh[c:])
    chunk32 = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in chunk_args]
    out = prefill_attention(*chunk32, 0.2, window, softcap)
    torch.testing.assert_close(out.double(), fresh[c:], atol=1e-5, rtol=1e-5)


def test_rejects_bad_inputs():
    args = make_inputs([3, 4], [0, 2], 4, 2, 64, 16, torch.float32)
    q, k, v, kc, vc, bt, cu, ctx, mx = args

    def call(**kw):
        a = dict(q=q, k=k, v=v, k_cache=kc, v_cache=vc, block_tables=bt, cu_seqlens_q=cu, context_lens=ctx,
                 max_seqlen_q=mx, scale=0.125)  # fmt: skip
        a.update(kw)
        return prefill_attention(**a)

    with pytest.raises(ValueError, match="num query heads 3 .* num kv heads 2"):
        call(q=q[:, :3])
    with pytest.raises(ValueError, match="head dim 320"):
        wide = [torch.cat([x] * 5, dim=-1) for x in (q, k, v, kc, vc)]
        call(q=wide[0], k=wide[1], v=wide[2], k_cache=wide[3], v_cache=wide[4])
    with pytest.raises(ValueError, match=r"k.dtype=torch.float16 does not match q.dtype=torch.float32"):
        call(k=k.half())
    with pytest.raises(ValueError, match="context_lens must be a 1-D int32"):
        call(context_lens=ctx.long())
    with pytest.raises(ValueError, match="cu_seqlens_q has 2 entries"):
        call(cu_seqlens_q=cu[:2])
    with pytest.raises(ValueError, match="sliding_window=0"):
        call(sliding_window=0)
    with pytest.raises(ValueError, match="softcap=-1.0"):
        call(softcap=-1.0)
    with pytest.raises(ValueError, match="unit stride"):
        call(q=q.transpose(1, 2).contiguous().transpose(1, 2))


@pytest.mark.interpreter  # on CPU the op is opaque only under the interpreter (llmplug_op)
def test_opcheck():
    args = make_inputs([2, 3], [0, 17], 2, 1, 64, 16, torch.float32)
    torch.library.opcheck(torch.ops.llmplug.prefill_attention.default,
                          (*args, 0.125, -1, 0.0, torch.empty_like(args[0])))


@pytest.mark.interpreter  # on CPU the op is opaque only under the interpreter (llmplug_op)
def test_compiles():
    args = make_inputs([4, 6], [9, 0], 2, 1, 64, 16, torch.float32)
    fn = torch.compile(lambda *a: prefill_attention(*a, 0.125) * 2, fullgraph=True)
    torch.testing.assert_close(fn(*args), prefill_attention_ref(*args, 0.125) * 2, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels only: run with TRITON_INTERPRET=0")
@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("window, softcap", [(-1, 0.0), (300, 0.0), (-1, 50.0)])
def test_gpu_matches_reference(d, window, softcap):
    """The compiled kernel with its GPU tile sizes, on longer sequences (several query/key tiles and pages)."""
    args = make_inputs([1, 300, 1000], [0, 129, 700], 8, 2, d, 16, torch.bfloat16, device="cuda")
    out = prefill_attention(*args, d**-0.5, window, softcap)
    ref64 = prefill_attention_ref(*to64(args), d**-0.5, window, softcap)
    assert_close_matmul_like(out, ref64, prefill_attention_ref(*args, d**-0.5, window, softcap))


# ---- fp8 / int8 caches -----------------------------------------------------------------------------------------------
def quantize_args(args, kv_dtype):
    """``make_inputs`` output with fp8/int8 pages, plus ``(k_scale, v_scale)`` (NaN where the cache is poisoned)."""
    (kq, ks), (vq, vs) = quantize_pages(args[3], kv_dtype), quantize_pages(args[4], kv_dtype)
    return [*args[:3], kq, vq, *args[5:]], {"k_scale": ks, "v_scale": vs}


QUANT_CASES = [
    pytest.param(BF16, 64, 4, 4, 16, [1], [40], -1, 0.0, id="1row-mha-d64-bf16"),
    pytest.param(F16, 128, 8, 2, 16, [1, 19, 7], [0, 33, 50], -1, 0.0, id="19rows-gqa4-d128-f16"),
    pytest.param(F32, 64, 4, 1, 8, [19], [45], 24, 30.0, id="19rows-gqa4-d64-p8-window-softcap-f32"),
    pytest.param(BF16, 128, 2, 2, 16, [19, 1], [33, 70], -1, 0.0, id="19rows-mha-d128-bf16"),
]


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("dtype, d, h, hkv, page, seqlens, ctx_lens, window, softcap", QUANT_CASES)
def test_quantized_cache_matches_reference(kv_dtype, dtype, d, h, hkv, page, seqlens, ctx_lens, window, softcap):
    args, scales = quantize_args(make_inputs(seqlens, ctx_lens, h, hkv, d, page, dtype), kv_dtype)
    out = prefill_attention(*args, d**-0.5, window, softcap, **scales)
    assert out.shape == args[0].shape and out.dtype == dtype
    ref64 = prefill_attention_ref(*to64(args), d**-0.5, window, softcap, **scales)
    assert_close_matmul_like(out, ref64, prefill_attention_ref(*args, d**-0.5, window, softcap, **scales))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("h, hkv, d", [(2, 2, 64), (8, 2, 128)])
def test_quantized_reference_close_to_unquantized(kv_dtype, h, hkv, d):
    args = make_inputs([1, 19], [100, 300], h, hkv, d, 16, torch.float64)
    args[3], args[4] = args[3].nan_to_num(0.0), args[4].nan_to_num(0.0)
    qargs, scales = quantize_args(args, kv_dtype)
    got = prefill_attention_ref(*qargs, d**-0.5, **scales)
    assert sqnr_db(prefill_attention_ref(*args, d**-0.5), got) >= KV_CACHE_SQNR_DB[kv_dtype]


@pytest.mark.interpreter  # on CPU the op is opaque only under the interpreter (llmplug_op)
def test_quantized_bad_inputs_and_opcheck():
    args, scales = quantize_args(make_inputs([2, 3], [0, 17], 2, 1, 64, 16, torch.float32), torch.int8)
    with pytest.raises(ValueError, match="needs k_scale"):
        prefill_attention(*args, 0.125)
    with pytest.raises(ValueError, match="dtype"):
        prefill_attention(*args[:4], args[4].to(torch.float8_e4m3fn), *args[5:], 0.125, **scales)
    torch.library.opcheck(torch.ops.llmplug.prefill_attention.default,
                          (*args, 0.125, -1, 0.0, torch.empty_like(args[0]), scales["k_scale"], scales["v_scale"]))


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
def test_out_writes_rows_of_a_larger_buffer(reference):
    """``out=`` rows of a larger buffer get exactly what a fresh output gets, and nothing around them changes."""
    from llmplug.ops._triton import cpu_kernels

    args = make_inputs([1, 19, 37], [0, 5, 33], 4, 1, 64, 16, torch.bfloat16)
    t = args[0].shape[0]
    with cpu_kernels(INTERPRET and not reference):
        want = prefill_attention(*args, 0.125)
        buf = torch.full((t + 2, 4, 64), 7.0, dtype=torch.bfloat16)
        got = prefill_attention(*args, 0.125, out=buf[1:t + 1])
    assert got.data_ptr() == buf[1:t + 1].data_ptr()
    assert torch.equal(buf[1:t + 1], want) and (buf[0] == 7).all() and (buf[-1] == 7).all()
    with pytest.raises(ValueError, match="out is"):
        prefill_attention(*args, 0.125, out=buf[:2])
