"""The paged KV pool: one tensor for all layers, pages of ``block_size`` tokens."""

from __future__ import annotations

import os

import torch

from ..ops.kv_quant import is_quantized
from .allocator import BlockAllocator
from .prefix_cache import BlockManager

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}  # OptimizeConfig.kv_cache_dtype -> storage


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for ``OptimizeConfig.kv_cache_dtype``: ``"auto"`` is the model's dtype."""
    return KV_CACHE_DTYPES.get(kv_cache_dtype, model_dtype)


SPLIT_COUNTERS = 1024
CUDA_FRACTION = 0.6  # of free GPU memory (after weights), where no kv_memory_fraction is given
CPU_POOL_BYTES = 1 << 30  # the CPU pool where neither kv_num_blocks nor kv_memory_fraction is given


class PagedKVCache:
    """K and V pages for every layer, allocated once.

    ``k[layer], v[layer]: (num_blocks, P, Hkv, D)``; token ``i`` of a sequence whose pages are ``blocks`` sits at
    slot ``blocks[i // P] * P + i % P``. An fp8/int8 pool also holds ``k_scale[layer], v_scale[layer]:
    (num_blocks, Hkv, P)`` fp32, one scale per token and kv head (:mod:`llmplug.ops.kv_quant`); otherwise both are
    None.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k_scale = self.v_scale = None
        if is_quantized(dtype):
            scale_shape = (num_layers, num_blocks, num_kv_heads, block_size)
            self.k_scale = torch.empty(scale_shape, dtype=torch.float32, device=device)
            self.v_scale = torch.empty(scale_shape, dtype=torch.float32, device=device)
        # the flash-decoding splits of a decode attention launch count their finishes here, one counter a sequence and
        # kv head, left zeros (:func:`~llmplug.ops.rope_decode_attention.rope_decode_attention`); batches with more
        # rows x kv heads than this do not split the context anyway
        self.split_counters = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        # every user of the pool (generate's batches, the engine) takes blocks through this one manager, so blocks the
        # engine keeps in its prefix cache are evicted for whoever needs them
        self.blocks = BlockManager(self.allocator, block_size, enable_prefix_caching=False)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V, scales included (4 bytes a token and head, fp8/int8)."""
        per_row = head_dim * dtype.itemsize + (4 if is_quantized(dtype) else 0)
        return 2 * num_layers * block_size * num_kv_heads * per_row

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every per-block tensor of the pool, block index in dim 1: ``k, v`` and, when quantized, their scales."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    @property
    def block_bytes(self) -> int:
        """Bytes one block of this pool takes (every layer, K and V, scales included)."""
        return sum(t[:, 0].numel() * t.element_size() for t in self.tensors)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s contents (every layer, scales too) into block ``dst`` (copy-on-write)."""
        for t in self.tensors:
            t[:, dst] = t[:, src]

    @staticmethod
    def budget_bytes(device: torch.device, fraction: float | None) -> int:
        """Bytes the pool may take: ``fraction`` of free device memory (CUDA) or of physical memory (CPU).

        ``fraction=None`` (``OptimizeConfig.kv_memory_fraction``'s default): :data:`CUDA_FRACTION` of free memory on
        CUDA, :data:`CPU_POOL_BYTES` on CPU, whose memory the pool shares with everything else on the machine.
        """
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * (CUDA_FRACTION if fraction is None else fraction))
        if fraction is None:
            return CPU_POOL_BYTES
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Layer ``i``'s ``(k, v, k_scale, v_scale)``: pages ``(num_blocks, P, Hkv, D)``, scales
        ``(num_blocks, Hkv, P)`` fp32 or None."""
        if self.k_scale is None:
            return self.k[i], self.v[i], None, None
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]

    def slot(self, blocks: list[int], position: int) -> int:
        return blocks[position // self.block_size] * self.block_size + position % self.block_size
