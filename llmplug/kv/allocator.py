"""Block allocator for the paged KV pool, and per-sequence block lists that grow with the sequence."""

from __future__ import annotations

from ..errors import KVCacheFullError


class BlockAllocator:
    """Hands out page ids ``0..num_blocks-1``; freed pages are reused most-recently-freed first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh page ids; raises :class:`KVCacheFullError` (allocating nothing) if fewer are free."""
        if n > len(self._free):
            raise KVCacheFullError(
                f"the KV cache needs {n} more pages of the {self.num_blocks} in its pool but only {len(self._free)} "
                "are free: shorten the prompts or max_new_tokens, use a smaller batch, or give llmplug a bigger "
                "pool (optimize(model, kv_num_blocks=...) or kv_memory_fraction=...)"
            )
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._used[b] = True
        return out

    def free(self, blocks: list[int]) -> None:
        """Return pages to the pool; freeing a page twice raises."""
        for b in blocks:
            if not self._used[b]:
                raise ValueError(f"block {b} is not allocated")
            self._used[b] = False
            self._free.append(b)


class SequenceBlocks:
    """The pages of one sequence, grown a page at a time as tokens arrive (never reserved up front).

    ``allocator`` is anything with ``allocate(n)`` and ``free(blocks)``: a :class:`BlockAllocator` or the pool's
    ``BlockManager``.
    """

    def __init__(self, allocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.blocks: list[int] = []

    def ensure(self, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens in all; True when new pages were added."""
        need = -(-num_tokens // self.block_size) - len(self.blocks)
        if need <= 0:
            return False
        self.blocks.extend(self.allocator.allocate(need))
        return True

    def release(self) -> None:
        self.allocator.free(self.blocks)
        self.blocks = []
