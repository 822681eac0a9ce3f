"""BlockManager: reference counts, prefix caching, LRU eviction and copy-on-write on top of BlockAllocator."""

import random

import pytest

from llmplug.errors import KVCacheFullError
from llmplug.kv.allocator import BlockAllocator
from llmplug.kv.prefix_cache import ROOT, BlockManager, PrefixStats

P = 4  # block size used throughout


def make(num_blocks: int = 8, enabled: bool = True) -> BlockManager:
    return BlockManager(BlockAllocator(num_blocks), P, enable_prefix_caching=enabled)


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def prefill(mgr: BlockManager, tokens: list[int]) -> tuple[list[int], list[int]]:
    """What the scheduler does for a new prompt: reuse cached blocks, allocate the rest, cache the full ones."""
    blocks, ids = mgr.match(tokens)
    blocks = blocks + mgr.allocate(-(-len(tokens) // P) - len(blocks))
    parent = ids[-1] if ids else ROOT
    for i in range(len(ids), len(tokens) // P):
        parent = mgr.register(blocks[i], parent, tokens[i * P:(i + 1) * P])
        ids.append(parent)
    return blocks, ids


def num_evictable(mgr: BlockManager) -> int:
    return mgr.num_free - mgr.allocator.num_free


# ---- allocation and reference counts ----------------------------------------------------------------------------
def test_allocate_holds_each_block_once():
    mgr = make(8)
    blocks = mgr.allocate(3)
    assert len(set(blocks)) == 3 and all(0 <= b < 8 for b in blocks)
    assert mgr.ref == {b: 1 for b in blocks}
    assert (mgr.num_used, mgr.num_free, mgr.num_total) == (3, 5, 8)
    assert not any(mgr.is_shared(b) for b in blocks)


def test_allocate_zero_is_empty():
    mgr = make(2)
    assert mgr.allocate(0) == []
    assert (mgr.num_used, mgr.num_free) == (0, 2)


def test_free_uncached_blocks_go_back_to_the_allocator():
    mgr = make(8)
    blocks = mgr.allocate(3)
    mgr.free(blocks)
    assert mgr.ref == {}
    assert mgr.allocator.num_free == 8 and mgr.num_free == 8 and mgr.num_used == 0


def test_hold_adds_a_holder_and_free_drops_one():
    mgr = make(4)
    a, b = mgr.allocate(2)
    mgr.hold([a, b])
    assert mgr.ref == {a: 2, b: 2} and mgr.is_shared(a) and mgr.is_shared(b)
    mgr.free([a, b])
    assert mgr.ref == {a: 1, b: 1} and not mgr.is_shared(a)
    assert mgr.num_used == 2 and mgr.allocator.num_free == 2
    mgr.free([a, b])
    assert mgr.ref == {} and mgr.allocator.num_free == 4


def test_free_of_an_unheld_block_raises():
    mgr = make(4)
    (a,) = mgr.allocate(1)
    mgr.free([a])
    with pytest.raises((KeyError, ValueError)):
        mgr.free([a])
    assert mgr.allocator.num_free == 4


def test_allocate_more_than_free_raises_and_allocates_nothing():
    mgr = make(4)
    held = mgr.allocate(3)
    with pytest.raises(KVCacheFullError, match="needs 2 more pages of the 4 in its pool but only 1 are free"):
        mgr.allocate(2)
    assert (mgr.num_used, mgr.num_free, mgr.allocator.num_free) == (3, 1, 1)
    assert set(mgr.ref) == set(held)


def test_allocate_past_evictable_blocks_raises_without_evicting():
    mgr = make(4)
    tokens = toks(2 * P + 1)
    blocks, _ = prefill(mgr, tokens)  # 3 blocks, the 2 full ones cached
    mgr.free(blocks)
    mgr.allocate(1)
    assert (mgr.num_free, num_evictable(mgr)) == (3, 2)
    with pytest.raises(KVCacheFullError):
        mgr.allocate(4)
    assert mgr.stats.evictions == 0 and num_evictable(mgr) == 2 and mgr.num_used == 1
    assert mgr.match(tokens)[0] == blocks[:2]  # nothing was evicted


# ---- prefix matching -------------------------------------------------------------------------------------------
def test_match_returns_the_longest_cached_chain_and_its_entry_ids():
    mgr = make(16)
    tokens = toks(3 * P + 1)
    blocks, ids = prefill(mgr, tokens)
    assert len(ids) == 3 and len(set(ids)) == 3 and ROOT not in ids
    mgr.free(blocks)

    got, got_ids = mgr.match(tokens[:3 * P] + [99, 98])
    assert got == blocks[:3] and got_ids == ids
    mgr.free(got)

    got, got_ids = mgr.match(tokens[:2 * P] + [99] * (P + 1))  # third block differs
    assert got == blocks[:2] and got_ids == ids[:2]
    mgr.free(got)

    got, got_ids = mgr.match([99] + tokens[1:])  # first block differs: nothing after it can match
    assert got == [] and got_ids == []


def test_match_stops_at_the_first_gap_in_the_chain():
    mgr = make(8)
    a, b, c = mgr.allocate(3)
    id_a = mgr.register(a, ROOT, toks(P))
    id_b = mgr.register(b, id_a, toks(P, 10))
    mgr.register(c, id_b + 1000, toks(P, 20))  # c hangs off a parent that is not b
    got, _ = mgr.match(toks(P) + toks(P, 10) + toks(P, 20) + [0])
    assert got == [a, b]


@pytest.mark.parametrize("n, expected", [(0, 0), (1, 0), (P, 0), (P + 1, 1), (2 * P - 1, 1), (2 * P, 1),
                                         (2 * P + 1, 2), (3 * P, 2)])
def test_match_always_leaves_a_token_to_compute(n, expected):
    mgr = make(8)
    tokens = toks(3 * P)
    blocks, _ = prefill(mgr, tokens)  # all three blocks cached
    mgr.free(blocks)
    got, ids = mgr.match(tokens[:n])
    assert got == blocks[:expected] and len(ids) == expected
    assert len(got) * P < max(n, 1)


def test_match_holds_the_blocks_it_returns():
    mgr = make(8)
    tokens = toks(2 * P + 1)
    blocks, _ = prefill(mgr, tokens)
    got, _ = mgr.match(tokens)  # still held by the first sequence: now shared
    assert got == blocks[:2] and all(mgr.ref[b] == 2 for b in got) and all(mgr.is_shared(b) for b in got)
    mgr.free(blocks)
    assert all(mgr.ref[b] == 1 for b in got)
    mgr.free(got)
    assert num_evictable(mgr) == 2 and mgr.num_used == 0

    free_before = mgr.num_free
    got, _ = mgr.match(tokens)  # unheld cached blocks come back to life
    assert mgr.ref == {b: 1 for b in got} and mgr.num_free == free_before - 2 and num_evictable(mgr) == 0


def test_match_with_prefix_caching_disabled_finds_nothing_and_register_returns_root():
    mgr = make(8, enabled=False)
    tokens = toks(2 * P + 1)
    blocks, ids = prefill(mgr, tokens)
    assert ids == [ROOT, ROOT]
    assert mgr.register(blocks[0], ROOT, tokens[:P]) == ROOT
    assert mgr.match(tokens) == ([], [])
    assert mgr.stats.hit_tokens == 0 and mgr.stats.hit_rate == 0.0
    mgr.free(blocks)
    assert mgr.allocator.num_free == 8 and num_evictable(mgr) == 0  # nothing cached, nothing kept


def test_key_includes_the_parent_so_equal_tokens_after_other_prefixes_do_not_match():
    mgr = make(8)
    first, second = toks(P), toks(P, 50)
    a, b = mgr.allocate(2)
    id_a = mgr.register(a, ROOT, first)
    id_b = mgr.register(b, id_a, second)
    assert mgr.match(second + [0]) == ([], [])  # `second` is cached, but only after `first`
    assert mgr.match(toks(P, 7) + second + [0]) == ([], [])

    (c,) = mgr.allocate(1)
    id_c = mgr.register(c, ROOT, second)  # the same tokens at the root are another entry
    assert id_c not in (id_a, id_b)
    got, ids = mgr.match(second + [0])
    assert (got, ids) == ([c], [id_c])
    mgr.free(got)
    got, ids = mgr.match(first + second + [0])
    assert (got, ids) == ([a, b], [id_a, id_b])


def test_register_is_idempotent_for_the_same_block():
    mgr = make(4)
    (a,) = mgr.allocate(1)
    entry = mgr.register(a, ROOT, toks(P))
    assert mgr.register(a, ROOT, toks(P)) == entry
    (b,) = mgr.allocate(1)
    assert mgr.register(b, entry, toks(P, 10)) not in (ROOT, entry)


def test_register_of_a_duplicate_key_returns_the_existing_id_and_leaves_the_block_uncached():
    mgr = make(4)
    tokens = toks(P)
    a, b = mgr.allocate(2)  # two requests computed the same first block at once
    id_a = mgr.register(a, ROOT, tokens)
    assert mgr.register(b, ROOT, tokens) == id_a

    mgr.free([b])  # the duplicate is not cached: straight back to the allocator
    assert mgr.allocator.num_free == 3 and num_evictable(mgr) == 0
    mgr.free([a])  # the original is cached: kept for reuse
    assert mgr.allocator.num_free == 3 and num_evictable(mgr) == 1
    assert mgr.match(tokens + [0]) == ([a], [id_a])


def test_duplicate_ids_still_chain():
    mgr = make(8)
    tokens = toks(2 * P + 1)
    first, ids_first = prefill(mgr, tokens)
    a, b = mgr.allocate(2)  # computed concurrently, without a match
    parent = mgr.register(a, ROOT, tokens[:P])
    assert mgr.register(b, parent, tokens[P:2 * P]) == ids_first[1]
    mgr.free([a, b])
    assert mgr.allocator.num_free == 8 - 3  # both duplicates went back to the pool


# ---- eviction ------------------------------------------------------------------------------------------------------
def test_cached_blocks_are_evicted_only_when_the_pool_is_out_of_free_blocks():
    mgr = make(4)
    tokens = toks(2 * P + 1)
    blocks, _ = prefill(mgr, tokens)
    mgr.free(blocks)
    assert (mgr.allocator.num_free, num_evictable(mgr), mgr.num_free) == (2, 2, 4)

    spare = mgr.allocate(2)  # the two never-cached blocks are used first
    assert set(spare).isdisjoint(blocks[:2]) and mgr.stats.evictions == 0
    got, _ = mgr.match(tokens)
    assert got == blocks[:2]
    mgr.free(got)


def test_free_evicts_the_tail_before_the_head():
    mgr = make(3)
    tokens = toks(3 * P)
    blocks, _ = prefill(mgr, tokens)
    mgr.free(blocks)
    assert mgr.allocator.num_free == 0 and num_evictable(mgr) == 3

    assert mgr.allocate(1) == [blocks[2]]  # least recently used: the tail
    assert mgr.stats.evictions == 1
    got, _ = mgr.match(tokens + [0])
    assert got == blocks[:2]  # the head survives; the evicted tail no longer matches
    mgr.free(got)

    assert mgr.allocate(1) == [blocks[1]]
    assert mgr.stats.evictions == 2
    got, _ = mgr.match(tokens + [0])
    assert got == blocks[:1]
    mgr.free(got)

    assert mgr.allocate(1) == [blocks[0]]
    assert mgr.stats.evictions == 3 and mgr.match(tokens + [0]) == ([], [])
    assert mgr.num_free == 0 and mgr.num_used == 3


def test_eviction_is_least_recently_used_first():
    mgr = make(2)
    x, y = toks(P + 1), toks(P + 1, 100)
    (bx,), _ = prefill(mgr, x[:P])
    mgr.free([bx])
    (by,), _ = prefill(mgr, y[:P])
    mgr.free([by])  # LRU order: x, y
    got, _ = mgr.match(x)  # touch x: LRU order y, x
    mgr.free(got)

    assert mgr.allocate(1) == [by]
    assert mgr.match(y) == ([], [])
    assert mgr.match(x)[0] == [bx]


def test_evicting_a_block_evicts_only_as_many_as_needed():
    mgr = make(4)
    tokens = toks(4 * P)
    blocks, _ = prefill(mgr, tokens)
    mgr.free(blocks)
    assert len(mgr.allocate(2)) == 2
    assert mgr.stats.evictions == 2 and num_evictable(mgr) == 2


def test_hold_revives_an_evictable_block():
    mgr = make(3)
    tokens = toks(P)
    blocks, _ = prefill(mgr, tokens)
    mgr.free(blocks)
    assert num_evictable(mgr) == 1 and mgr.num_free == 3

    mgr.hold(blocks)
    assert mgr.ref == {blocks[0]: 1} and mgr.num_free == 2 and num_evictable(mgr) == 0
    others = mgr.allocate(2)
    assert blocks[0] not in others and mgr.stats.evictions == 0
    with pytest.raises(KVCacheFullError):
        mgr.allocate(1)
    mgr.free(blocks)
    assert mgr.match(tokens + [0])[0] == blocks  # still cached after its revival


# ---- copy on write ---------------------------------------------------------------------------------------------
def test_copy_on_write_returns_a_new_block_and_drops_one_holder_of_the_old():
    mgr = make(4)
    (old,) = mgr.allocate(1)
    mgr.hold([old])
    assert mgr.is_shared(old)
    new = mgr.copy_on_write(old)
    assert new != old
    assert mgr.ref == {old: 1, new: 1}
    assert not mgr.is_shared(old) and not mgr.is_shared(new)
    assert mgr.num_used == 2 and mgr.num_free == 2


def test_copy_on_write_keeps_the_old_block_cached_for_its_other_holders():
    mgr = make(4)
    tokens = toks(P)
    (old,), _ = prefill(mgr, tokens)
    mgr.hold([old])
    new = mgr.copy_on_write(old)
    assert new not in (old,) and mgr.ref[old] == 1
    mgr.free([new])
    assert mgr.allocator.num_free == 3  # the private copy was never cached
    mgr.free([old])
    assert mgr.match(tokens + [0])[0] == [old]


def test_copy_on_write_on_a_full_pool_raises_and_keeps_the_holders():
    mgr = make(2)
    a, _ = mgr.allocate(2)
    mgr.hold([a])
    with pytest.raises(KVCacheFullError):
        mgr.copy_on_write(a)
    assert mgr.ref[a] == 2 and mgr.num_used == 2


def test_copy_on_write_can_evict_a_cached_block():
    mgr = make(2)
    tokens = toks(P)
    cached, _ = prefill(mgr, tokens)
    mgr.free(cached)
    (a,) = mgr.allocate(1)
    mgr.hold([a])
    assert mgr.copy_on_write(a) == cached[0]
    assert mgr.stats.evictions == 1 and mgr.ref == {a: 1, cached[0]: 1}
    assert mgr.match(tokens + [0]) == ([], [])


# ---- stats and reset -------------------------------------------------------------------------------------------
def test_hit_rate_arithmetic():
    assert PrefixStats().hit_rate == 0.0
    assert PrefixStats(queried_tokens=10, hit_tokens=4).hit_rate == pytest.approx(0.4)
    assert PrefixStats(queried_tokens=8, hit_tokens=8).hit_rate == 1.0


def test_stats_count_queried_and_hit_tokens():
    mgr = make(8)
    tokens = toks(2 * P + 1)
    blocks, _ = prefill(mgr, tokens)  # 9 queried, 0 hit
    assert (mgr.stats.queried_tokens, mgr.stats.hit_tokens, mgr.stats.hit_rate) == (2 * P + 1, 0, 0.0)
    got, _ = mgr.match(tokens)  # 9 queried, 8 hit
    assert (mgr.stats.queried_tokens, mgr.stats.hit_tokens) == (2 * (2 * P + 1), 2 * P)
    assert mgr.stats.hit_rate == pytest.approx(2 * P / (2 * (2 * P + 1)))
    mgr.match(toks(P + 1, 500))  # a miss
    assert mgr.stats.hit_tokens == 2 * P and mgr.stats.queried_tokens == 2 * (2 * P + 1) + P + 1
    assert mgr.stats.evictions == 0


def test_reset_cache_frees_unheld_blocks_and_uncaches_held_ones():
    mgr = make(8)
    a_tokens, b_tokens = toks(2 * P + 1), toks(2 * P, 100)
    a, _ = prefill(mgr, a_tokens)
    b, _ = prefill(mgr, b_tokens)
    mgr.free(a)
    assert num_evictable(mgr) == 2

    mgr.reset_cache()
    assert mgr.allocator.num_free == 8 - len(b) and num_evictable(mgr) == 0
    assert mgr.ref == {blk: 1 for blk in b}  # held blocks stay held
    assert mgr.match(a_tokens) == ([], []) and mgr.match(b_tokens + [0]) == ([], [])
    mgr.free(b)  # no longer cached: straight back to the allocator
    assert mgr.allocator.num_free == 8 and mgr.num_free == 8


def test_every_block_returns_to_the_pool():
    mgr = make(12)
    shared = toks(2 * P)
    s1, _ = prefill(mgr, shared + toks(P + 2, 100))
    s2, _ = prefill(mgr, shared + toks(3, 200))  # reuses the first two blocks
    assert s2[:2] == s1[:2]
    fork = list(s2)
    mgr.hold(fork)  # n=2: a sample shares its sibling's blocks
    fork[-1] = mgr.copy_on_write(fork[-1])
    (extra,) = mgr.allocate(1)
    fork.append(extra)
    for seq in (s1, s2, fork):
        mgr.free(seq)
    assert mgr.num_used == 0 and mgr.ref == {}
    assert mgr.num_free == 12 and num_evictable(mgr) > 0 and mgr.allocator.num_free < 12
    mgr.reset_cache()
    assert mgr.allocator.num_free == 12 and mgr.num_free == 12
    assert sorted(mgr.allocate(12)) == list(range(12))


# ---- randomized invariants ---------------------------------------------------------------------------------------
def check_invariants(mgr: BlockManager) -> None:
    held, evictable = set(mgr.ref), set(mgr._evictable)
    free = set(mgr.allocator._free)
    assert len(free) == mgr.allocator.num_free  # no block twice in the free list
    assert mgr.num_used + mgr.num_free == mgr.num_total
    assert not held & evictable, "a block both held and evictable"
    assert not free & (held | evictable), "a block both free and in use"
    assert held | evictable | free == set(range(mgr.num_total)), "a block leaked"
    assert all(count >= 1 for count in mgr.ref.values())
    assert evictable <= set(mgr._entry_of), "an evictable block that is not cached"
    assert set(mgr._id_of) == set(mgr._entry_of)
    assert len(set(mgr._id_of.values())) == len(mgr._id_of) and ROOT not in mgr._id_of.values()
    for key, block in mgr._block_of.items():
        assert mgr._entry_of[block] == key
    for block, key in mgr._entry_of.items():
        assert mgr._block_of[key] == block


def test_random_operations_keep_the_invariants():
    rng = random.Random(1234)
    mgr = make(12)
    stem = [rng.randrange(3) for _ in range(2 * P)]  # prompts share stems so that prefixes repeat often
    templates = [stem + [rng.randrange(3) for _ in range(2 * P)] for _ in range(3)]
    content: dict[int, tuple[int, ...]] = {}  # block -> the whole prefix its content ends (what a model would write)
    seqs: list[list[int]] = []  # block lists of live sequences
    holders: dict[int, int] = {}

    def take(blocks):
        for b in blocks:
            holders[b] = holders.get(b, 0) + 1

    def drop(blocks):
        for b in blocks:
            holders[b] -= 1
            if not holders[b]:
                del holders[b]

    for _ in range(400):
        op = rng.random() * (1.0 if len(seqs) < 4 else 0.5) + (0.0 if len(seqs) < 4 else 0.5)
        if op < 0.45:  # admit a prompt
            tokens = rng.choice(templates)[:rng.randint(1, 4 * P)]
            if rng.random() < 0.3:
                tokens[rng.randrange(len(tokens))] = rng.randrange(3)
            use_cache = rng.random() < 0.8  # else: computed concurrently with an equal prompt (duplicates)
            blocks, ids = mgr.match(tokens) if use_cache else ([], [])
            assert len(blocks) * P < len(tokens) and len(ids) == len(blocks)
            for i, b in enumerate(blocks):
                assert content[b] == tuple(tokens[:(i + 1) * P]), "matched a block of another prefix"
            take(blocks)
            need = -(-len(tokens) // P) - len(blocks)
            free_before, used_before = mgr.num_free, mgr.num_used
            try:
                fresh = mgr.allocate(need)
            except KVCacheFullError:
                assert need > free_before
                assert (mgr.num_free, mgr.num_used) == (free_before, used_before)
                mgr.free(blocks)
                drop(blocks)
            else:
                take(fresh)
                for j, b in enumerate(fresh, start=len(blocks)):
                    content[b] = tuple(tokens[:(j + 1) * P])
                blocks += fresh
                parent = ids[-1] if ids else ROOT
                for i in range(len(ids), len(tokens) // P):
                    parent = mgr.register(blocks[i], parent, tokens[i * P:(i + 1) * P])
                    assert parent != ROOT
                seqs.append(blocks)
        elif op < 0.55 and seqs:  # fork
            blocks = list(rng.choice(seqs))
            mgr.hold(blocks)
            take(blocks)
            seqs.append(blocks)
        elif op < 0.62 and seqs:  # copy-on-write of a random block of a live sequence
            blocks = rng.choice(seqs)
            i = rng.randrange(len(blocks))
            if mgr.is_shared(blocks[i]) and mgr.num_free:
                new = mgr.copy_on_write(blocks[i])
                drop([blocks[i]])
                take([new])
                content[new] = content[blocks[i]]
                blocks[i] = new
        elif op < 0.98 and seqs:  # finish a sequence
            blocks = seqs.pop(rng.randrange(len(seqs)))
            mgr.free(blocks)
            drop(blocks)
        elif op >= 0.98:
            mgr.reset_cache()
        assert mgr.ref == holders
        check_invariants(mgr)

    assert mgr.stats.hit_tokens > 0 and mgr.stats.evictions > 0  # the run exercised both
    for blocks in seqs:
        mgr.free(blocks)
    check_invariants(mgr)
    assert mgr.ref == {}
    mgr.reset_cache()
    assert mgr.allocator.num_free == mgr.num_total == mgr.num_free
