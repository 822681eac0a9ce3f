"""Gemma: ``(1 + w)`` RMSNorm, GELU-tanh MLP, scaled embeddings (done by the HF embedding module)."""

from .decoder import FamilySpec

SPEC = FamilySpec(model_types=("gemma",), norm_offset=1.0)
