import math

import pytest
import torch

from llmplug.ops import decode_attention as dmod
from llmplug.ops._paged_decode import choose_num_splits, tile_config
from llmplug.ops._triton import cpu_kernels
from llmplug.ops.decode_attention import decode_attention, decode_attention_ref
from llmplug.quant.formats import sqnr_db
from tests.ops.test_kv_quant import KV_DTYPES, quantize_pages
from tests.tolerances import KV_CACHE_SQNR_DB, assert_close_matmul_like


def _paged(lens, num_heads, num_kv_heads, head_dim, page, dtype, window=-1, poison=True):
    """Random decode inputs over a paged cache with shuffled, non-contiguous block tables.

    With ``poison``: cache memory no sequence may read (blocks nobody owns, page tails past ``seq_lens``, tokens before
    a sliding window) is NaN, and block-table entries past a sequence's pages are out-of-range ids, so reading any of
    them shows up as NaN or a crash.
    """
    bsz = len(lens)
    pages = [math.ceil(n / page) for n in lens]
    width = max(pages + [1]) + 1
    num_blocks = sum(pages) + 3
    fill = float("nan") if poison else 0.0
    k_cache = torch.full((num_blocks, page, num_kv_heads, head_dim), fill, dtype=dtype)
    v_cache = torch.full_like(k_cache, fill)
    block_tables = torch.full((bsz, width), num_blocks + 1000 if poison else 0, dtype=torch.int32)
    perm, used = torch.randperm(num_blocks), 0
    for b, n in enumerate(lens):
        blocks = perm[used : used + pages[b]]
        used += pages[b]
        block_tables[b, : pages[b]] = blocks.to(torch.int32)
        first = max(0, n - window) if (window > 0 and poison) else 0
        for i in range(first, n):
            blk, off = blocks[i // page], i % page
            k_cache[blk, off] = torch.randn(num_kv_heads, head_dim).to(dtype)
            v_cache[blk, off] = torch.randn(num_kv_heads, head_dim).to(dtype)
    q = torch.randn(bsz, num_heads, head_dim).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32)


def _check(q, k_cache, v_cache, block_tables, seq_lens, window=-1, softcap=0.0, splits=0):
    scale = q.shape[-1] ** -0.5
    out = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, _num_splits=splits)
    ref64 = decode_attention_ref(
        q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens, scale, window, softcap
    )
    same = decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert_close_matmul_like(out, ref64, same)
    assert (out[seq_lens == 0] == 0).all(), "padding rows must be zeros"
    return out


# Each feature in a few combinations rather than the cross product (the interpreter is slow).
CASES = {
    # name: (seq_lens, H, Hkv, D, P, dtype, sliding_window, softcap, num_splits (0: heuristic))
    "mha-fp32-1split": ([1, 17, 100], 4, 4, 64, 16, torch.float32, -1, 0.0, 1),
    "gqa4-bf16-splits": ([1, 17, 100], 8, 2, 128, 16, torch.bfloat16, -1, 0.0, 4),
    "mqa8-d80-p8-padding": ([33, 0, 100, 5, 64, 0, 17], 8, 1, 80, 8, torch.float16, -1, 0.0, 3),
    "d256-p32-window-b1": ([150], 8, 1, 256, 32, torch.bfloat16, 40, 0.0, 2),
    "window-softcap-fp32": ([1, 17, 100], 4, 1, 64, 16, torch.float32, 24, 5.0, 3),
    "softcap50-fp16-auto": ([60, 130, 9], 8, 2, 128, 16, torch.float16, -1, 50.0, 0),
    "window-bf16-1split": ([100, 3, 70], 4, 4, 80, 16, torch.bfloat16, 33, 0.0, 1),
    "gqa8-softcap-fp32-d256": ([7, 40], 8, 1, 256, 16, torch.float32, -1, 30.0, 2),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_reference(case):
    lens, num_heads, num_kv_heads, head_dim, page, dtype, window, softcap, splits = CASES[case]
    inputs = _paged(lens, num_heads, num_kv_heads, head_dim, page, dtype, window)
    _check(*inputs, window=window, softcap=softcap, splits=splits)


def test_strided_q_and_changing_seq_lens():
    """q as a view into a fused qkv output; then new ``seq_lens`` in the same tensor (a CUDA-graph replay)."""
    lens, num_heads, num_kv_heads, head_dim = [40, 90, 0], 4, 2, 64
    _, k_cache, v_cache, block_tables, seq_lens = _paged(lens, num_heads, num_kv_heads, head_dim, 16, torch.float16)
    qkv = torch.randn(len(lens), (num_heads + 2 * num_kv_heads) * head_dim).half()
    q = qkv[:, : num_heads * head_dim].view(len(lens), num_heads, head_dim)
    assert not q.is_contiguous()
    _check(q, k_cache, v_cache, block_tables, seq_lens, splits=2)
    seq_lens.copy_(torch.tensor([17, 0, 0], dtype=torch.int32))  # no longer than before: only stored tokens
    _check(q, k_cache, v_cache, block_tables, seq_lens, splits=2)


@pytest.mark.parametrize("window", [-1, 40])
def test_splits_without_tiles_are_never_read(monkeypatch, window):
    """Splits past a sequence's last tile write nothing: with the split buffers filled with a large finite value (a
    log-sum-exp that would outweigh every real split), the combine must read only the splits holding tiles (short,
    long and empty sequences side by side; a sliding window moves the first tile)."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(1e4) if t.is_floating_point() else t

    inputs = _paged([3, 150, 0, 70], 8, 2, 64, 16, torch.float32, window=window)
    monkeypatch.setattr(torch, "empty", poisoned_empty)
    _check(*inputs, window=window, splits=8)


@pytest.mark.parametrize("splits", [1, 3])
def test_all_padding_rows_are_zero(splits):
    q, k_cache, v_cache, block_tables, seq_lens = _paged([0, 0], 4, 2, 64, 16, torch.bfloat16)
    out = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, _num_splits=splits)
    assert torch.equal(out, torch.zeros_like(out))


def test_none_means_no_window_and_no_softcap():
    inputs = _paged([5, 30], 4, 2, 64, 16, torch.float32, poison=False)
    torch.testing.assert_close(decode_attention(*inputs, 0.125, None, None), decode_attention(*inputs, 0.125, -1, 0.0))


def test_reference_path_of_op():
    inputs = _paged([5, 30], 4, 2, 64, 16, torch.float32, poison=False)
    with cpu_kernels(False):
        out = decode_attention(*inputs, 0.125, 16, 10.0)
    torch.testing.assert_close(out, decode_attention_ref(*inputs, 0.125, 16, 10.0))


def test_reference_matches_naive_loop():
    """The oracle itself, against a per-sequence, per-head loop in fp64."""
    lens, num_heads, num_kv_heads, head_dim, page, window, cap = [1, 37, 20], 6, 2, 32, 8, 25, 4.0
    q, k_cache, v_cache, block_tables, seq_lens = _paged(lens, num_heads, num_kv_heads, head_dim, page, torch.float64)
    ref = decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, 0.3, window, cap)
    for b, n in enumerate(lens):
        keys = range(max(0, n - window), n)
        slots = [(block_tables[b, i // page].item(), i % page) for i in keys]
        for h in range(num_heads):
            kvh = h // (num_heads // num_kv_heads)
            k = torch.stack([k_cache[blk, off, kvh] for blk, off in slots])
            v = torch.stack([v_cache[blk, off, kvh] for blk, off in slots])
            scores = cap * torch.tanh(k @ q[b, h] * 0.3 / cap)
            torch.testing.assert_close(ref[b, h], torch.softmax(scores, 0) @ v)


def test_num_splits_heuristic():
    # H200-like: 132 SMs, 8 kv heads, 8k context in 64-token tiles.
    assert choose_num_splits(1, 8, 8192, 64, 132) >= 16  # batch 1 spreads the context over the SMs
    assert choose_num_splits(64, 8, 8192, 64, 132) == 1  # batch 64 fills the GPU without splitting
    assert choose_num_splits(1, 8, 100, 64, 132) == 1  # too short to split
    assert 1 <= choose_num_splits(1, 1, 10**7, 16, 10**4) <= 64
    assert choose_num_splits(1, 8, 384, 64, 132) == 1  # a paged context: at least four tiles a split
    assert choose_num_splits(1, 8, 384, 64, 132, min_tiles=1) == 4  # a dense cache's: one tile each


def test_dense_caches_split_to_one_tile():
    q = torch.zeros(1, 32, 64)
    block_n = dmod.tile_config(64, 4, 4, 8)[0]
    # a split a tile, rounded up to a power of two: 3 tiles -> 4 splits, 5 -> 8 (2 programs an SM: 2 * 4 interpreter
    # SMs over 1 kv head allow 8), 20 -> 8
    for tiles, splits in ((3, 4), (5, 8), (20, 8)):
        assert dmod.launch_splits(q, torch.zeros(1, tiles * block_n - 1, 1, 64), None, -1) == splits
    pages = torch.zeros(16, 16, 1, 64)  # paged: at least four tiles a split
    table = torch.zeros(1, (3 * block_n) // 16, dtype=torch.int32)
    assert dmod.launch_splits(q, pages, table, -1) == 1


def test_tiles_by_gpu():
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert tile_config(64, 2, 2, 1024, h100) == (32, 4, 3) == tile_config(64, 2, 2, 1024)
    assert tile_config(64, 2, 2, 1024, h200) == (64, 4, 2)  # more bytes in flight on the faster memory
    assert tile_config(64, 2, 2, 256, h200) == (128, 4, 3)
    assert tile_config(64, 2, 2, 255, h200) == tile_config(64, 2, 2, 512, h100) == (64, 4, 3)
    assert tile_config(128, 2, 2, 1024, h200) == tile_config(128, 2, 2, 1024, h100) == (64, 4, 3)
    assert tile_config(64, 2, 1, 1024, h200) == (128, 4, 3)  # 1-byte pages: their own rule


@pytest.mark.parametrize("tile", [(64, 4, 2), (128, 4, 3)])
def test_h200_tiles(monkeypatch, tile):
    """The tiles the H200 gets, on the interpreter: odd lengths over several tiles, 1 and 3 splits."""
    monkeypatch.setattr(dmod, "tile_config", lambda *a: tile)
    torch.manual_seed(5)
    case = _paged([1, 130, 300, 77], 8, 2, 64, 16, torch.bfloat16)
    with cpu_kernels(True):
        for splits in (1, 3):
            _check(*case, splits=splits)


def test_bad_inputs():
    q, k_cache, v_cache, block_tables, seq_lens = _paged([5, 9], 4, 2, 64, 16, torch.float32, poison=False)
    with pytest.raises(ValueError, match="H=3"):
        decode_attention(q[:, :3], k_cache, v_cache, block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(q.half(), k_cache, v_cache, block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="q must be"):
        decode_attention(q[0], k_cache, v_cache, block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="head dim"):
        decode_attention(q[..., :32], k_cache, v_cache, block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        decode_attention(q, k_cache, v_cache, block_tables, seq_lens.long(), 0.125)
    with pytest.raises(ValueError, match="block_tables must be"):
        decode_attention(q, k_cache, v_cache, block_tables[:1], seq_lens, 0.125)


def test_more_rows_than_the_grid_takes_are_refused():
    rows = 65536
    q, k_cache, v_cache = torch.zeros(rows, 2, 16), torch.zeros(1, 16, 1, 16), torch.zeros(1, 16, 1, 16)
    tables, lens = torch.zeros(rows, 1, dtype=torch.int32), torch.ones(rows, dtype=torch.int32)
    with cpu_kernels(True), pytest.raises(ValueError, match="at most 65535 rows a launch, got 65536"):
        decode_attention(q, k_cache, v_cache, tables, lens, 0.25)


def test_opcheck():
    q, k_cache, v_cache, block_tables, seq_lens = _paged([3, 20], 4, 2, 64, 16, torch.float32, poison=False)
    args = (q, k_cache, v_cache, block_tables, seq_lens, 0.125, -1, 0.0, 2, torch.empty_like(q))
    torch.library.opcheck(torch.ops.llmplug.decode_attention.default, args)


def test_compiles():
    inputs = _paged([3, 20], 4, 2, 64, 16, torch.float32, poison=False)
    fn = torch.compile(lambda *a: decode_attention(*a, 0.125) * 2, fullgraph=True)
    torch.testing.assert_close(fn(*inputs), decode_attention_ref(*inputs, 0.125) * 2)


# ---- fp8 / int8 caches -----------------------------------------------------------------------------------------------
def _quantized(k_cache, v_cache, kv_dtype):
    """``(k_pages, v_pages, k_scale, v_scale)``; NaN (poisoned) rows get NaN scales, so reading them still shows."""
    (kq, ks), (vq, vs) = quantize_pages(k_cache, kv_dtype), quantize_pages(v_cache, kv_dtype)
    return kq, vq, ks, vs


LENS_19 = [1, 17, 70, 5, 40, 0, 33, 2, 24, 9, 41, 3, 16, 30, 8, 25, 50, 12, 36]
QUANT_CASES = {
    # name: (seq_lens, H, Hkv, D, P, dtype, sliding_window, softcap, num_splits (0: heuristic))
    "b1-mha-d64-bf16": ([77], 4, 4, 64, 16, torch.bfloat16, -1, 0.0, 0),
    "b19-gqa4-d128-fp16-splits": (LENS_19, 4, 1, 128, 16, torch.float16, -1, 0.0, 2),
    "b19-gqa4-d64-p8-fp32-window-softcap": (LENS_19, 4, 1, 64, 8, torch.float32, 20, 30.0, 1),
    "b19-mha-d128-bf16-1split": (LENS_19, 2, 2, 128, 16, torch.bfloat16, -1, 0.0, 1),
}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("case", list(QUANT_CASES), ids=list(QUANT_CASES))
def test_quantized_cache_matches_reference(kv_dtype, case):
    lens, num_heads, num_kv_heads, head_dim, page, dtype, window, softcap, splits = QUANT_CASES[case]
    q, k_cache, v_cache, block_tables, seq_lens = _paged(lens, num_heads, num_kv_heads, head_dim, page, dtype, window)
    kq, vq, ks, vs = _quantized(k_cache, v_cache, kv_dtype)
    scale, kw = head_dim**-0.5, dict(k_scale=ks, v_scale=vs)
    out = decode_attention(q, kq, vq, block_tables, seq_lens, scale, window, softcap, _num_splits=splits, **kw)
    ref64 = decode_attention_ref(q.double(), kq, vq, block_tables, seq_lens, scale, window, softcap, **kw)
    same = decode_attention_ref(q, kq, vq, block_tables, seq_lens, scale, window, softcap, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close_matmul_like(out, ref64, same)
    assert (out[seq_lens == 0] == 0).all(), "padding rows must be zeros"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantized_fp16_small_values_do_not_underflow(kv_dtype):
    """Near-uniform attention over 300 keys (p ~ 3e-3) of V ~ 1e-3 (scales ~ 1e-5): ``p * v_scale`` is below fp16's
    smallest subnormal, so the kernel must keep the V scales out of the fp16 ``p``'s range."""
    q, k_cache, v_cache, block_tables, seq_lens = _paged([300, 150], 4, 1, 64, 16, torch.float16, poison=False)
    kq, vq, ks, vs = _quantized(k_cache * 0.01, v_cache * 1e-3, kv_dtype)
    kw = dict(k_scale=ks, v_scale=vs)
    out = decode_attention(q, kq, vq, block_tables, seq_lens, 0.125, _num_splits=1, **kw)
    ref64 = decode_attention_ref(q.double(), kq, vq, block_tables, seq_lens, 0.125, **kw)
    assert_close_matmul_like(out, ref64, decode_attention_ref(q, kq, vq, block_tables, seq_lens, 0.125, **kw))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(2, 2, 64), (8, 2, 128)])
def test_quantized_reference_close_to_unquantized(kv_dtype, num_heads, num_kv_heads, head_dim):
    inputs = _paged([1, 19, 100, 300], num_heads, num_kv_heads, head_dim, 16, torch.float64, poison=False)
    q, k_cache, v_cache, block_tables, seq_lens = inputs
    kq, vq, ks, vs = _quantized(k_cache, v_cache, kv_dtype)
    got = decode_attention_ref(q, kq, vq, block_tables, seq_lens, head_dim**-0.5, k_scale=ks, v_scale=vs)
    want = decode_attention_ref(*inputs, head_dim**-0.5)
    assert sqnr_db(want, got) >= KV_CACHE_SQNR_DB[kv_dtype]


def test_quantized_bad_inputs():
    q, k_cache, v_cache, block_tables, seq_lens = _paged([5, 9], 4, 2, 64, 16, torch.float32, poison=False)
    kq, vq, ks, vs = _quantized(k_cache, v_cache, torch.int8)
    with pytest.raises(ValueError, match="needs k_scale"):
        decode_attention(q, kq, vq, block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="only for fp8/int8"):
        decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(q, kq, vq.to(torch.float8_e4m3fn), block_tables, seq_lens, 0.125, k_scale=ks, v_scale=vs)


def test_quantized_opcheck():
    q, k_cache, v_cache, block_tables, seq_lens = _paged([3, 20], 4, 2, 64, 16, torch.float32, poison=False)
    kq, vq, ks, vs = _quantized(k_cache, v_cache, torch.int8)
    args = (q, kq, vq, block_tables, seq_lens, 0.125, -1, 0.0, 2, torch.empty_like(q), ks, vs)
    torch.library.opcheck(torch.ops.llmplug.decode_attention.default, args)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "reference"])
def test_out_writes_rows_of_a_larger_buffer(splits, kernels):
    """``out=`` rows of a larger buffer get exactly what a fresh output gets, and nothing around them changes."""
    q, k_cache, v_cache, block_tables, seq_lens = _paged([5, 0, 40], 4, 2, 64, 16, torch.bfloat16)
    with cpu_kernels(kernels):
        want = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, _num_splits=splits)
        buf = torch.full((5, 4, 64), 7.0, dtype=torch.bfloat16)
        got = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, out=buf[1:4], _num_splits=splits)
    assert got.data_ptr() == buf[1:4].data_ptr()
    assert torch.equal(buf[1:4], want) and (buf[0] == 7).all() and (buf[4] == 7).all()
    with pytest.raises(ValueError, match="out is"):
        decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, out=buf[:2])
    with pytest.raises(ValueError, match="out is"):
        decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, out=buf[1:4].float())
