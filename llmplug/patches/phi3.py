"""Phi-3: q/k/v and gate/up already fused in the checkpoint; sliding window from the config."""

from .decoder import FamilySpec

SPEC = FamilySpec(model_types=("phi3",), window_from_config=True)
