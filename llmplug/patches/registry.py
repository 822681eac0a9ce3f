"""Which families have fused patches, and which models llmplug can run at all."""

from __future__ import annotations

import torch
from transformers import GenerationMixin, PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..errors import UnsupportedModelError
from . import gemma, gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3
from .decoder import FamilySpec, text_decoder

FAMILIES: dict[str, FamilySpec] = {
    t: mod.SPEC for mod in (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3, phi3) for t in mod.SPEC.model_types
}

# HF activation names -> llmplug's act_and_mul names
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def family_of(model: torch.nn.Module) -> tuple[FamilySpec, str] | None:
    """``(spec, activation)`` for a model llmplug has fusions for, else None (generic path).

    A multimodal wrapper (Gemma3ForConditionalGeneration, Llava, ...) fuses its text stack. One whose text config caps
    the final logits runs the generic path: whether its head applies that cap is up to the wrapper class (PaliGemma's
    does, Gemma 3's does not).
    """
    text = model.config.get_text_config()
    spec = FAMILIES.get(text.model_type)
    act = ACTIVATIONS.get(getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", None))
    if spec is None or act is None or text_decoder(model) is None or not hasattr(model, "lm_head"):
        return None
    if text is not model.config and getattr(text, "final_logit_softcapping", None) is not None:
        return None
    return spec, act


_SUPPORTED = (f"Supported: fused: {sorted(FAMILIES)}; any other decoder-only HF causal LM whose attention uses "
              "transformers.AttentionInterface")


def _no_lm_head(model: torch.nn.Module, model_type: str) -> str:
    """Why a transformers model without ``generate`` (``AutoModel``'s base model, an encoder, a classifier) cannot
    run, and what to load instead."""
    what = f"{type(model).__name__} (model_type={model_type!r}) has no language-model head, so it cannot generate"
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
        return (f"{what}; load the checkpoint with transformers.AutoModelForCausalLM.from_pretrained(...) "
                f"(which gives {cls}) and optimize that")
    return f"{what}, and transformers has no causal LM class for model_type={model_type!r}. {_SUPPORTED}"


def check_supported(model: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` unless the model is a decoder-only HF LM that llmplug can drive."""
    config = getattr(model, "config", None)
    if not isinstance(config, PreTrainedConfig):
        raise UnsupportedModelError(f"llmplug runs Hugging Face transformers models; {type(model).__name__} has no "
                                    f"transformers config. {_SUPPORTED}")
    if not hasattr(model, "generate"):
        raise UnsupportedModelError(_no_lm_head(model, config.model_type))
    reason = None
    if config.is_encoder_decoder:
        reason = "encoder-decoder models are not supported"
    elif type(model).generate is not GenerationMixin.generate:
        reason = (f"{type(model).__name__} has its own generate (a multimodal or speech front end), which llmplug's "
                  "generate would bypass")
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
        raise UnsupportedModelError(f"llmplug cannot run {type(model).__name__} (model_type={config.model_type!r}): "
                                    f"{reason}. {_SUPPORTED}")
