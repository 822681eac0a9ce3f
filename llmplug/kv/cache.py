"""The paged KV pool: one tensor for all layers, pages of ``block_size`` tokens."""

from __future__ import annotations

import os

import torch

from .allocator import BlockAllocator
from .prefix_cache import BlockManager


class PagedKVCache:
    """K and V pages for every layer, allocated once.

    ``k[layer], v[layer]: (num_blocks, P, Hkv, D)``; token ``i`` of a sequence whose pages are ``blocks`` sits at
    slot ``blocks[i // P] * P + i % P``.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        # every user of the pool (generate's batches, the engine) takes blocks through this one manager, so blocks the
        # engine keeps in its prefix cache are evicted for whoever needs them
        self.blocks = BlockManager(self.allocator, block_size, enable_prefix_caching=False)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def budget_bytes(device: torch.device, fraction: float) -> int:
        """Bytes the pool may take: ``fraction`` of free device memory (CUDA) or of physical memory (CPU)."""
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * fraction)
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def slot(self, blocks: list[int], position: int) -> int:
        return blocks[position // self.block_size] * self.block_size + position % self.block_size
