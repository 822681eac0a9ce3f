"""Gemma 2: Gemma plus sandwich norms, attention logit soft-capping, alternating sliding window, final softcap."""

from .decoder import FamilySpec

SPEC = FamilySpec(model_types=("gemma2",), norm_offset=1.0, sandwich_norms=True)
