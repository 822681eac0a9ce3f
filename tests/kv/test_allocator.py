import pytest

import llmplug
from llmplug.kv.allocator import BlockAllocator
from llmplug.ops._triton import cpu_kernels
from llmplug.state import state_of
from tests.tiny_models import make_model, pad, prompts


def test_allocate_free_reuse():
    pool = BlockAllocator(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    pool.free(a[:2])
    assert pool.num_free == 3
    b = pool.allocate(3)
    assert set(b) & set(a[:2]) and a[2] not in b
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[2], a[2]])


def test_full_pool_raises_and_allocates_nothing():
    pool = BlockAllocator(3)
    pool.allocate(2)
    with pytest.raises(llmplug.KVCacheFullError, match="2 more pages of the 3 in its pool but only 1"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_generate_past_the_pool_raises_then_recovers():
    model = make_model("llama")
    llmplug.optimize(model, kv_num_blocks=4, kv_block_size=8)
    ids, mask = pad(prompts(2, lengths=(20, 9)))
    with cpu_kernels(False):
        with pytest.raises(llmplug.KVCacheFullError, match="kv_num_blocks"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30)
        assert state_of(model).runner.cache.allocator.num_free == 4  # the failed call gave its pages back
        out = model.generate(input_ids=ids[1:], attention_mask=mask[1:], max_new_tokens=5)
    assert out.shape == (1, ids.shape[1] + 5)
