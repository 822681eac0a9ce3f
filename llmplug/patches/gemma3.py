"""Gemma 3 (text): Gemma 2's layout plus q/k norms and separate local/global RoPE per layer type."""

from .decoder import FamilySpec

SPEC = FamilySpec(model_types=("gemma3_text",), norm_offset=1.0, sandwich_norms=True, rope_per_layer_type=True)
