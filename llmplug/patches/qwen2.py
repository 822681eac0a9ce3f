"""Qwen2 / Qwen2.5: q/k/v biases (fused with the weights), per-layer sliding window from the attention module."""

from .decoder import FamilySpec

SPEC = FamilySpec(model_types=("qwen2",))
