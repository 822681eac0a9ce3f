"""Reference-counted KV blocks with prefix caching on top of :class:`BlockAllocator`.

A full block is cached under the key ``(parent entry id, its token ids)``: the parent's entry id stands for the whole
prefix before it, so equal keys mean equal prefixes (exact, no hash collisions). Blocks nobody holds but whose content
is cached stay in an LRU list and are evicted only when the pool has no free block left.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..errors import KVCacheFullError
from .allocator import BlockAllocator

ROOT = 0  # parent entry id of a sequence's first block


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of which found in the cache
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    """Hands out KV blocks with reference counts; shares and caches full blocks of equal prefixes.

    Args:
        allocator: the pool's page allocator (the manager takes every block it hands out from it).
        block_size: tokens per block.
        enable_prefix_caching: cache full blocks (``register``) and find them again (``match``).
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = enable_prefix_caching
        self.ref: dict[int, int] = {}  # block -> holders (blocks in use)
        self._entry_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # cached block -> its key
        self._block_of: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> cached block
        self._id_of: dict[int, int] = {}  # cached block -> entry id (parent id of the next block)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld blocks, least recently used first
        self._next_id = ROOT + 1
        self.stats = PrefixStats()

    @property
    def num_total(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: never used, or cached but held by nobody."""
        return self.allocator.num_free + len(self._evictable)

    @property
    def num_used(self) -> int:
        return len(self.ref)

    # ---- allocation ------------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks held once each, evicting least recently used cached blocks when needed."""
        if n > self.num_free:
            raise KVCacheFullError(
                f"the KV cache needs {n} more pages of the {self.num_total} in its pool but only {self.num_free} are "
                "free: shorten the prompts or max_new_tokens, use a smaller batch, or give llmplug a bigger pool "
                "(optimize(model, kv_num_blocks=...) or kv_memory_fraction=...)")
        while self.allocator.num_free < n:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            self.allocator.free([block])
            self.stats.evictions += 1
        out = self.allocator.allocate(n)
        for b in out:
            self.ref[b] = 1
        return out

    def hold(self, blocks: list[int]) -> None:
        """One more holder for each block (a forked sequence sharing its parent's blocks, or a cache hit)."""
        for b in blocks:
            if b in self._evictable:
                del self._evictable[b]
                self.ref[b] = 1
            else:
                self.ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each block, last block first, so a sequence's tail is evicted before its head."""
        for b in reversed(blocks):
            count = self.ref[b] - 1
            if count:
                self.ref[b] = count
                continue
            del self.ref[b]
            if b in self._entry_of:
                self._evictable[b] = None
            else:
                self.allocator.free([b])

    def is_shared(self, block: int) -> bool:
        return self.ref[block] > 1

    def copy_on_write(self, block: int) -> int:
        """A private block to write into in place of the shared ``block`` (the caller copies its content)."""
        (new,) = self.allocate(1)
        self.free([block])
        return new

    # ---- prefix cache ----------------------------------------------------------------------------------------
    def unmatch(self, blocks: list[int], num_tokens: int) -> None:
        """Give back a :meth:`match` of a ``num_tokens`` prompt that could not be used (its lookup is not counted)."""
        self.free(blocks)
        if self.enabled:
            self.stats.queried_tokens -= num_tokens
            self.stats.hit_tokens -= len(blocks) * self.block_size

    def match(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Hold the cached blocks of the longest cached prefix of ``tokens``, leaving at least one token to compute.

        Returns ``(blocks, entry_ids)``: ``blocks[i]`` holds ``tokens[i*P:(i+1)*P]``; ``entry_ids[i]`` is the parent id
        of block ``i + 1``.
        """
        P = self.block_size
        blocks, ids = [], []
        if self.enabled:
            parent = ROOT
            for i in range((len(tokens) - 1) // P):
                block = self._block_of.get((parent, tuple(tokens[i * P:(i + 1) * P])))
                if block is None:
                    break
                blocks.append(block)
                parent = self._id_of[block]
                ids.append(parent)
            self.stats.queried_tokens += len(tokens)
            self.stats.hit_tokens += len(blocks) * P
        self.hold(blocks)
        return blocks, ids

    def register(self, block: int, parent: int, tokens: list[int]) -> int:
        """Cache the full ``block`` holding ``tokens`` after the prefix ``parent``; returns its entry id.

        If an equal block is cached already (two requests computed the same prefix at once), ``block`` stays uncached
        and the existing entry's id is returned, so later keys still chain.
        """
        if not self.enabled:
            return ROOT
        key = (parent, tuple(tokens))
        existing = self._block_of.get(key)
        if existing is not None:
            return self._id_of[existing]
        if block in self._entry_of:
            raise ValueError(f"block {block} is cached already under another prefix")
        self._block_of[key] = block
        self._entry_of[block] = key
        self._id_of[block] = self._next_id
        self._next_id += 1
        return self._id_of[block]

    def _forget(self, block: int) -> None:
        key = self._entry_of.pop(block)
        del self._block_of[key]
        del self._id_of[block]

    def reset_cache(self) -> None:
        """Drop every cached entry (held blocks stay held, uncached)."""
        for b in list(self._evictable):
            self.allocator.free([b])
        self._evictable.clear()
        self._entry_of.clear()
        self._block_of.clear()
        self._id_of.clear()
