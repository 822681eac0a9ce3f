"""Block allocator for the paged KV pool."""

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
