import pytest
import torch

from llmplug.ops._triton import cpu_kernels
from llmplug.ops.kv_store import store_kv, store_kv_ref

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


def test_opcheck():
    k, v = _fused_kv(4, 4, 2, 64, torch.float32)
    caches = torch.zeros(2, 8, 2, 64), torch.zeros(2, 8, 2, 64)
    slots = torch.tensor([5, -1, 9, 15])
    torch.library.opcheck(torch.ops.llmplug.store_kv.default, (k, v, *caches, slots))


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
