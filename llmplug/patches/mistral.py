"""Mistral: Llama plus a sliding window read from the config."""

from .decoder import FamilySpec

SPEC = FamilySpec(model_types=("mistral",), window_from_config=True)
