"""CPU swap space for preempted sequences' KV blocks (pinned on CUDA so copies run asynchronously)."""

from __future__ import annotations

import torch

from .allocator import BlockAllocator
from .cache import PagedKVCache


class SwapSpace:
    """``k, v: (L, num_blocks, P, Hkv, D)`` on the CPU; blocks are handed out by an allocator of their own."""

    def __init__(self, cache: PagedKVCache, num_blocks: int) -> None:
        shape = (cache.k.shape[0], num_blocks) + tuple(cache.k.shape[2:])
        pin = cache.k.device.type == "cuda"
        self.k = torch.empty(shape, dtype=cache.k.dtype, pin_memory=pin)
        self.v = torch.empty(shape, dtype=cache.v.dtype, pin_memory=pin)
        self.cache = cache
        self.allocator = BlockAllocator(num_blocks)

    @classmethod
    def sized(cls, cache: PagedKVCache, gigabytes: float) -> SwapSpace | None:
        """A swap space of ``gigabytes`` (None if that holds no block)."""
        per_block = 2 * cache.k[:, 0].numel() * cache.k.element_size()
        n = int(gigabytes * 1e9) // per_block
        return cls(cache, n) if n > 0 else None

    def swap_out(self, blocks: list[int]) -> list[int]:
        """Copy device ``blocks`` into fresh CPU blocks; returns their ids (the device blocks may be reused after)."""
        slots = self.allocator.allocate(len(blocks))
        src = torch.tensor(blocks, device=self.cache.k.device)
        dst = torch.tensor(slots)
        self.k[:, dst] = self.cache.k[:, src].cpu()
        self.v[:, dst] = self.cache.v[:, src].cpu()
        return slots

    def swap_in(self, slots: list[int], blocks: list[int]) -> None:
        """Copy CPU ``slots`` into device ``blocks`` and free the slots."""
        dev = self.cache.k.device
        src = torch.tensor(slots)
        dst = torch.tensor(blocks, device=dev)
        self.cache.k[:, dst] = self.k[:, src].to(dev, non_blocking=True)
        self.cache.v[:, dst] = self.v[:, src].to(dev, non_blocking=True)
        self.allocator.free(slots)
