"""The KV pool's layout and sizing, quantized pools included, and the block copies that must carry the scales."""

import os

import pytest
import torch

from llmplug.kv.cache import PagedKVCache, kv_storage_dtype
from llmplug.kv.swap import SwapSpace
from llmplug.state import state_of

CPU = torch.device("cpu")


def _filled(dtype: torch.dtype, num_blocks: int = 6) -> PagedKVCache:
    cache = PagedKVCache(2, num_blocks, 4, 2, 8, dtype, CPU)
    for t in cache.tensors:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    return cache


def _block(cache: PagedKVCache, block: int) -> list[torch.Tensor]:
    return [t[:, block].clone() for t in cache.tensors]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                           y.view(torch.uint8) if y.element_size() == 1 else y) for x, y in zip(a, b, strict=True))


def test_storage_dtypes():
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_storage_dtype("int8", torch.float16) == torch.int8


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_layout(dtype):
    cache = _filled(dtype)
    assert cache.k.shape == (2, 6, 4, 2, 8) and cache.k.dtype == dtype
    assert cache.k_scale.shape == cache.v_scale.shape == (2, 6, 2, 4) and cache.k_scale.dtype == torch.float32
    k, v, k_scale, v_scale = cache.layer(1)
    assert k.data_ptr() == cache.k[1].data_ptr() and v_scale.data_ptr() == cache.v_scale[1].data_ptr()
    assert k_scale.shape == (6, 2, 4)
    assert len(cache.tensors) == 4
    assert cache.block_bytes == PagedKVCache.bytes_per_block(2, 4, 2, 8, dtype) == 2 * 2 * 4 * 2 * (8 + 4)
    plain = _filled(torch.bfloat16)
    assert plain.layer(0)[2:] == (None, None) and plain.k_scale is None and len(plain.tensors) == 2


@pytest.mark.parametrize("head_dim, at_least", [(128, 1.93), (64, 1.88)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_blocks_hold_about_twice_the_tokens(dtype, head_dim, at_least):
    """fp32 scales cost 4 bytes a token and head against the D bytes saved: 1.94x bf16 at D=128, 1.88x at D=64."""
    args = (32, 16, 8, head_dim)
    ratio = PagedKVCache.bytes_per_block(*args, torch.bfloat16) / PagedKVCache.bytes_per_block(*args, dtype)
    assert at_least <= ratio < 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn, torch.int8])
def test_copy_block_copies_pages_and_scales(dtype):
    cache = _filled(dtype)
    src, others = _block(cache, 1), [_block(cache, b) for b in (0, 2, 4, 5)]
    cache.copy_block(1, 3)
    assert _equal(_block(cache, 3), src) and _equal(_block(cache, 1), src)
    assert all(_equal(_block(cache, b), o) for b, o in zip((0, 2, 4, 5), others))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn, torch.int8])
def test_swap_round_trip_carries_scales(dtype):
    cache = _filled(dtype)
    swap = SwapSpace.sized(cache, (3 * cache.block_bytes + 0.5) / 1e9)
    assert swap.allocator.num_blocks == 3 and [t.dtype for t in swap.tensors] == [t.dtype for t in cache.tensors]
    before = [_block(cache, b) for b in (4, 1)]
    slots = swap.swap_out([4, 1])
    for t in cache.tensors:  # the device blocks get reused
        t[:, [4, 1]] = torch.zeros_like(t[:, [4, 1]])
    swap.swap_in(slots, [0, 5])
    assert _equal(_block(cache, 0), before[0]) and _equal(_block(cache, 5), before[1])
    assert swap.allocator.num_free == 3


def _pool_of(**options) -> PagedKVCache:
    """The KV pool ``llmplug.optimize(tiny llama, **options)`` allocates on the CPU."""
    import llmplug
    from tests.tiny_models import make_model

    model = make_model("llama")
    llmplug.optimize(model, **options)
    try:
        return state_of(model).runner.ensure_cache()
    finally:
        llmplug.unoptimize(model)


def test_cpu_pool_sizing():
    """CPU default: a 1 GiB pool (not a share of the machine's RAM); explicit fractions and page counts still rule."""
    pool = _pool_of()
    assert 1 << 30 >= pool.num_blocks * pool.block_bytes > (1 << 30) - pool.block_bytes
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    pool = _pool_of(kv_memory_fraction=0.001)
    assert pool.num_blocks == int(ram * 0.001) // pool.block_bytes
    assert _pool_of(kv_num_blocks=7, kv_memory_fraction=0.5).num_blocks == 7


@pytest.mark.parametrize("fraction", [0, 1.0, "0.5", -0.1])
def test_bad_memory_fraction_names_the_value(fraction):
    from llmplug import OptimizeConfig

    with pytest.raises(ValueError, match=rf"kv_memory_fraction={fraction!r} must be a float in \(0, 1\) or None"):
        OptimizeConfig(kv_memory_fraction=fraction)
