import pytest
import torch

from llmplug.ops._triton import cpu_kernels
from llmplug.ops.kv_quant import quantize_ref
from llmplug.ops.kv_store import store_kv, store_kv_ref
from tests.ops.test_kv_quant import KV_DTYPES, bits

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _fused_kv(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """``k, v: (T, Hkv, D)`` strided views into a fused ``(T, (H + 2 Hkv) D)`` qkv projection output."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    k_off, v_off = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    k = qkv[:, k_off:v_off].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, v_off:].view(num_tokens, num_kv_heads, head_dim)
    return k, v


def _expected(k, v, k_cache, v_cache, slots):
    """Token-by-token loop: the obvious semantics."""
    ek, ev = k_cache.clone(), v_cache.clone()
    page = k_cache.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            ek[s // page, s % page] = k[t]
            ev[s // page, s % page] = v[t]
    return ek, ev


def _slots(num_tokens, num_slots, skip):
    """Distinct random slots; the tokens at indices ``skip`` get -1 (skipped)."""
    slots = torch.randperm(num_slots)[:num_tokens].to(torch.int64)
    slots[list(skip)] = -1
    return slots


@pytest.mark.parametrize(
    "num_tokens, num_kv_heads, head_dim, page, dtype, skip",
    [
        (5, 2, 64, 16, torch.float32, [1]),
        (13, 1, 80, 8, torch.float16, [0, 7, 12]),
        (9, 8, 128, 16, torch.bfloat16, []),
        (3, 4, 256, 32, torch.bfloat16, [0, 1, 2]),  # every token skipped: nothing written
    ],
)
@pytest.mark.parametrize("impl", ["kernel", "ref"])
def test_store_matches_loop(num_tokens, num_kv_heads, head_dim, page, dtype, skip, impl):
    k, v = _fused_kv(num_tokens, 2 * num_kv_heads, num_kv_heads, head_dim, dtype)
    num_blocks = 4
    k_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim).to(dtype)
    slots = _slots(num_tokens, num_blocks * page, skip)
    ek, ev = _expected(k, v, k_cache, v_cache, slots)
    if impl == "kernel":
        store_kv(k, v, k_cache, v_cache, slots)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slots)
    # The whole cache: written slots hold the rows bit-exactly, every other slot is untouched.
    assert torch.equal(k_cache, ek)
    assert torch.equal(v_cache, ev)


def test_reference_path_of_op():
    k, v = _fused_kv(6, 4, 2, 64, torch.float32)
    k_cache, v_cache = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    slots = torch.tensor([3, -1, 31, 0, -5, 17])
    ek, ev = _expected(k, v, k_cache, v_cache, slots)
    with cpu_kernels(False):
        store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ek) and torch.equal(v_cache, ev)


def test_no_tokens():
    k_cache = torch.randn(2, 16, 2, 64)
    before = k_cache.clone()
    empty = torch.empty(0, 2, 64)
    store_kv(empty, empty, k_cache, k_cache.clone(), torch.empty(0, dtype=torch.int64))
    assert torch.equal(k_cache, before)


def test_bad_inputs():
    k = torch.randn(4, 2, 64)
    cache = torch.zeros(2, 16, 2, 64)
    slots = torch.arange(4)
    with pytest.raises(ValueError, match="dtype"):
        store_kv(k.half(), k.half(), cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="k must be"):
        store_kv(k[0], k[0], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="int64"):
        store_kv(k, k, cache, cache.clone(), slots.int())
    with pytest.raises(ValueError, match="does not match"):
        store_kv(k, k, torch.zeros(2, 16, 4, 64), torch.zeros(2, 16, 4, 64), slots)


@pytest.mark.interpreter  # on CPU the op is opaque only under the interpreter (llmplug_op)
def test_opcheck():
    k, v = _fused_kv(4, 4, 2, 64, torch.float32)
    caches = torch.zeros(2, 8, 2, 64), torch.zeros(2, 8, 2, 64)
    slots = torch.tensor([5, -1, 9, 15])
    torch.library.opcheck(torch.ops.llmplug.store_kv.default, (k, v, *caches, slots))


@pytest.mark.interpreter  # on CPU the op is opaque only under the interpreter (llmplug_op)
def test_compiles():
    def step(k, v, k_cache, v_cache, slots):
        store_kv(k * 2, v, k_cache, v_cache, slots)
        return k_cache.sum()

    fn = torch.compile(step, fullgraph=True)
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    k_cache, v_cache = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    slots = torch.tensor([4, -1, 20])
    ek, ev = _expected(k * 2, v, k_cache, v_cache, slots)
    fn(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ek) and torch.equal(v_cache, ev)


# ---- fp8 / int8 caches -----------------------------------------------------------------------------------------------
def _quantized_caches(num_blocks, page, num_kv_heads, head_dim, kv_dtype):
    """Random fp8/int8 pages and random scales (so untouched slots are recognisable)."""
    pages = [torch.randn(num_blocks, page, num_kv_heads, head_dim).to(kv_dtype) for _ in range(2)]
    scales = [torch.rand(num_blocks, num_kv_heads, page) for _ in range(2)]
    return pages + scales


def _expected_quantized(k, v, caches, slots):
    """Token-by-token loop over ``quantize_ref``: the obvious semantics."""
    ek, ev, eks, evs = (c.clone() for c in caches)
    page = ek.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            for rows, cache, scale in ((k, ek, eks), (v, ev, evs)):
                cache[s // page, s % page], scale[s // page, :, s % page] = quantize_ref(rows[t], cache.dtype)
    return ek, ev, eks, evs


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    "num_tokens, num_kv_heads, head_dim, page, dtype, skip",
    [
        (1, 2, 64, 16, torch.bfloat16, []),
        (19, 8, 128, 16, torch.float16, [0, 7, 18]),
        (19, 1, 80, 8, torch.float32, [3]),
        (3, 4, 256, 32, torch.bfloat16, [0, 1, 2]),  # every token skipped: nothing written
    ],
)
@pytest.mark.parametrize("impl", ["kernel", "ref"])
def test_quantized_store_matches_loop(kv_dtype, num_tokens, num_kv_heads, head_dim, page, dtype, skip, impl):
    """Values and scales bit-exact (kernel and reference alike), every other slot and scale untouched."""
    k, v = _fused_kv(num_tokens, 2 * num_kv_heads, num_kv_heads, head_dim, dtype)
    v.mul_(1e-3)  # a different magnitude per tensor
    caches = _quantized_caches(4, page, num_kv_heads, head_dim, kv_dtype)
    slots = _slots(num_tokens, 4 * page, skip)
    expected = _expected_quantized(k, v, caches, slots)
    (store_kv if impl == "kernel" else store_kv_ref)(k, v, *caches[:2], slots, *caches[2:])
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(bits(got), bits(want))


def test_quantized_bad_inputs():
    k = torch.randn(4, 2, 64)
    pages, _, scale, _ = _quantized_caches(2, 16, 2, 64, torch.int8)
    slots = torch.arange(4)
    with pytest.raises(ValueError, match="needs k_scale"):
        store_kv(k, k, pages, pages.clone(), slots)
    with pytest.raises(ValueError, match="only for fp8/int8"):
        store_kv(k, k, torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64), slots, scale, scale.clone())
    with pytest.raises(ValueError, match="dtype"):
        store_kv(k.to(torch.int8), k.to(torch.int8), pages, pages.clone(), slots, scale, scale.clone())


@pytest.mark.interpreter  # on CPU the op is opaque only under the interpreter (llmplug_op)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantized_opcheck_and_compile(kv_dtype):
    k, v = _fused_kv(4, 4, 2, 64, torch.bfloat16)
    caches = _quantized_caches(2, 8, 2, 64, kv_dtype)
    slots = torch.tensor([5, -1, 9, 15])
    if kv_dtype == torch.int8:  # opcheck's schema check multiplies tensors, which fp8 on CPU cannot
        fresh = [c.clone() for c in caches]
        torch.library.opcheck(torch.ops.llmplug.store_kv.default, (k, v, *fresh[:2], slots, *fresh[2:]))
    expected = _expected_quantized(k * 2, v, caches, slots)
    torch.compile(lambda *a: store_kv(a[0] * 2, *a[1:]), fullgraph=True)(k, v, *caches[:2], slots, *caches[2:])
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(bits(got), bits(want))
