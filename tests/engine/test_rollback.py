"""KV rollback of an engine sequence (pure Python): dropped tokens, pages back to the pool, cached blocks untouched."""

import pytest

from llmplug.engine.params import SamplingParams
from llmplug.engine.request import Request
from llmplug.kv.allocator import BlockAllocator
from llmplug.kv.prefix_cache import ROOT, BlockManager

P = 4


def _running(manager, prompt_len=6, generated=9, computed=None):
    """A sequence with ``prompt_len + generated`` tokens, ``computed`` of them with KV in blocks of ``manager``."""
    request = Request("r", list(range(10, 10 + prompt_len)), SamplingParams(max_new_tokens=64))
    seq = request.seqs[0]
    seq.tokens += list(range(100, 100 + generated))
    seq.num_computed = seq.num_tokens - 1 if computed is None else computed
    seq.resolved = seq.num_tokens
    seq.blocks = manager.allocate(-(-seq.num_computed // P))
    return seq


@pytest.mark.parametrize("k", [0, 1, 3, 4, 9])
def test_rollback_drops_tokens_and_frees_pages_past_the_end(k):
    manager = BlockManager(BlockAllocator(32), P, enable_prefix_caching=False)
    seq = _running(manager)  # 15 tokens, 14 computed: 4 blocks
    free = manager.num_free
    seq.rollback(k, manager)
    assert seq.num_tokens == 15 - k and seq.tokens[-1] == (100 + 8 - k if k < 9 else 15)
    assert seq.num_computed == min(14, 15 - k) and seq.resolved == 15 - k
    assert len(seq.blocks) == -(-seq.num_computed // P)
    assert manager.num_free == free + (4 - len(seq.blocks))


def test_rollback_of_a_fork_keeps_the_shared_pages_for_the_sibling():
    manager = BlockManager(BlockAllocator(32), P, enable_prefix_caching=False)
    seq = _running(manager)
    child = seq.fork(1)
    manager.hold(child.blocks)
    free = manager.num_free
    seq.rollback(9, manager)  # back to its 6-token prompt, 6 computed: 2 blocks
    assert manager.num_free == free  # the child still holds the two tail pages
    assert [manager.ref[b] for b in child.blocks] == [2, 2, 1, 1]


def test_rollback_never_cuts_into_a_prefix_cached_block():
    manager = BlockManager(BlockAllocator(32), P, enable_prefix_caching=True)
    seq = _running(manager)
    parent = ROOT
    for j in range(3):  # the first 12 tokens are cached (3 full blocks)
        parent = manager.register(seq.blocks[j], parent, seq.tokens[j * P:(j + 1) * P])
        seq.entry_ids.append(parent)
    seq.rollback(3, manager)  # 15 -> 12 tokens: the cached blocks stay whole
    with pytest.raises(ValueError, match="prefix-cached block 2"):
        seq.rollback(1, manager)
    assert seq.num_tokens == 12


def test_rollback_bounds():
    manager = BlockManager(BlockAllocator(32), P, enable_prefix_caching=False)
    seq = _running(manager, generated=2)
    for k in (-1, 3):
        with pytest.raises(ValueError, match=f"k={k}"):
            seq.rollback(k, manager)
