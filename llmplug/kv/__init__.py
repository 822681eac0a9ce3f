"""Paged KV cache: one preallocated pool of pages and the allocator that hands them out."""

from .allocator import BlockAllocator
from .cache import PagedKVCache

__all__ = ["BlockAllocator", "PagedKVCache"]
