"""Llama (and Llama-architecture checkpoints: Llama 2/3, TinyLlama, SmolLM, ...)."""

from .decoder import FamilySpec

SPEC = FamilySpec(model_types=("llama",))
