"""Qwen3: per-head RMSNorm on q and k before RoPE (found on the attention module as ``q_norm``/``k_norm``)."""

from .decoder import FamilySpec

SPEC = FamilySpec(model_types=("qwen3",))
