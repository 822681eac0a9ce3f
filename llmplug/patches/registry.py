"""Which families have fused patches, and which models llmplug can run at all."""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError
from . import gemma, gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3
from .decoder import FamilySpec

FAMILIES: dict[str, FamilySpec] = {
    t: mod.SPEC for mod in (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3, phi3) for t in mod.SPEC.model_types
}

# HF activation names -> llmplug's act_and_mul names
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def family_of(model: torch.nn.Module) -> tuple[FamilySpec, str] | None:
    """``(spec, activation)`` for a model llmplug has fusions for, else None (generic path)."""
    text = model.config.get_text_config()
    spec = FAMILIES.get(text.model_type)
    act = ACTIVATIONS.get(getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", None))
    if spec is None or act is None or not hasattr(model, "model") or not hasattr(model, "lm_head"):
        return None
    return spec, act


def check_supported(model: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` unless the model is a decoder-only HF LM that llmplug can drive."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    supported = f"fused: {sorted(FAMILIES)}; any other decoder-only HF causal LM whose attention uses " \
                "transformers.AttentionInterface"
    reason = None
    if config is None or not hasattr(model, "generate"):
        reason = "it is not a Hugging Face generative model"
    elif config.is_encoder_decoder:
        reason = "encoder-decoder models are not supported"
    elif not getattr(model, "_supports_attention_backend", False):
        reason = "its attention does not go through transformers.AttentionInterface"
    elif not any(hasattr(m, "layer_idx") for m in model.modules()):
        reason = "no attention layers with a layer_idx were found"
    else:
        text = config.get_text_config()
        if getattr(text, "layer_types", None) and any(
            t not in ("full_attention", "sliding_attention") for t in text.layer_types
        ):
            reason = f"it has layer types {sorted(set(text.layer_types))} (only attention layers are supported)"
    if reason:
        raise UnsupportedModelError(f"llmplug cannot run model_type={model_type!r}: {reason}. Supported: {supported}")
