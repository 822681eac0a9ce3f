"""CPU swap space for preempted sequences' KV blocks (pinned on CUDA so copies run asynchronously)."""

from __future__ import annotations

import torch

from .allocator import BlockAllocator
from .cache import PagedKVCache


class SwapSpace:
    """CPU twins of the pool's per-block tensors (``k, v: (L, num_blocks, P, Hkv, D)`` and, for an fp8/int8 pool,
    the scales ``(L, num_blocks, Hkv, P)``); blocks are handed out by an allocator of their own."""

    def __init__(self, cache: PagedKVCache, num_blocks: int) -> None:
        pin = cache.k.device.type == "cuda"
        self.tensors = [torch.empty((t.shape[0], num_blocks, *t.shape[2:]), dtype=t.dtype, pin_memory=pin)
                        for t in cache.tensors]
        self.cache = cache
        self.allocator = BlockAllocator(num_blocks)

    @classmethod
    def sized(cls, cache: PagedKVCache, gigabytes: float) -> SwapSpace | None:
        """A swap space of ``gigabytes`` (None if that holds no block)."""
        n = int(gigabytes * 1e9) // cache.block_bytes
        return cls(cache, n) if n > 0 else None

    def swap_out(self, blocks: list[int]) -> list[int]:
        """Copy device ``blocks`` into fresh CPU blocks; returns their ids (the device blocks may be reused after)."""
        slots = self.allocator.allocate(len(blocks))
        src = torch.tensor(blocks, device=self.cache.k.device)
        dst = torch.tensor(slots)
        for host, dev in zip(self.tensors, self.cache.tensors):
            host[:, dst] = dev[:, src].cpu()
        return slots

    def swap_in(self, slots: list[int], blocks: list[int]) -> None:
        """Copy CPU ``slots`` into device ``blocks`` and free the slots."""
        dev = self.cache.k.device
        src = torch.tensor(slots)
        dst = torch.tensor(blocks, device=dev)
        for host, pool in zip(self.tensors, self.cache.tensors):
            pool[:, dst] = host[:, src].to(dev, non_blocking=True)
        self.allocator.free(slots)
