"""Errors llmplug raises on purpose."""


class UnsupportedModelError(ValueError):
    """The model cannot run on llmplug (names its ``model_type`` and what is supported)."""


class KVCacheFullError(RuntimeError):
    """The paged KV pool has too few free blocks for the request."""
