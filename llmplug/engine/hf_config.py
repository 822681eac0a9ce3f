"""HF's :class:`GenerationConfig` read as llmplug :class:`SamplingParams`, the way HF's continuous batching reads it.

The config's own values count (no global defaults merged in); ``do_sample`` unset is greedy; options the engine cannot
apply raise, naming them; ``num_beams > 1`` warns and is ignored, as HF does. ``prompt_lookup_num_tokens`` (with
``max_matching_ngram_size``) makes every request speculate with prompt lookup, an ``assistant_model`` with that draft
model (stock HF's continuous batching ignores both).
"""

from __future__ import annotations

import warnings

import torch
from transformers import GenerationConfig

from .params import SamplingParams, SpeculativeConfig

__all__ = ["REQUEST_KEYS", "eos_ids", "sampling_fields"]

# GenerationConfig options the engine does not apply, with the values that leave generation unchanged.
_UNSUPPORTED = {
    "stop_strings": (), "max_time": (), "typical_p": (1.0,), "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,),
    "top_h": (), "penalty_alpha": (0.0,), "dola_layers": (), "no_repeat_ngram_size": (0,), "bad_words_ids": (),
    "suppress_tokens": (), "begin_suppress_tokens": (), "forced_bos_token_id": (), "forced_eos_token_id": (),
    "sequence_bias": (), "exponential_decay_length_penalty": (), "renormalize_logits": (False,),
    "watermarking_config": (), "guidance_scale": (1.0,), "num_beam_groups": (1,), "diversity_penalty": (0.0,),
}
# add_request(**kwargs) that may override the generation config for one request
REQUEST_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")


def _is_neutral(value, neutral: tuple) -> bool:
    if value is None or (isinstance(value, (list, tuple, dict)) and not value):
        return True
    return any(value == v for v in neutral)


def sampling_fields(config: GenerationConfig, assistant_model=None) -> dict:
    """The :class:`SamplingParams` fields ``config`` fixes for every request (validated now); ``assistant_model`` (an
    HF causal LM with the model's tokenizer) makes them speculate with it, ``num_assistant_tokens`` drafts a step."""
    bad = [f"{name}={getattr(config, name)!r}" for name, neutral in _UNSUPPORTED.items()
           if not _is_neutral(getattr(config, name, None), neutral)]
    if bad:
        raise ValueError(f"llmplug's continuous batching does not support {', '.join(bad)}; unset them. Supported: "
                         "do_sample, temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens, max_length, "
                         "min_new_tokens, min_length, eos_token_id, num_return_sequences")
    if (config.num_beams or 1) > 1:
        warnings.warn(f"num_beams={config.num_beams} is not supported by continuous batching (nor by HF's); "
                      "generating without beam search", stacklevel=3)
    fields = dict(do_sample=bool(config.do_sample), n=int(config.num_return_sequences or 1),
                  repetition_penalty=1.0 if config.repetition_penalty is None else float(config.repetition_penalty))
    if fields["do_sample"]:  # HF applies a warper only where the config sets it
        fields.update(temperature=1.0 if config.temperature is None else float(config.temperature),
                      top_k=int(config.top_k or 0), top_p=1.0 if config.top_p is None else float(config.top_p),
                      min_p=float(config.min_p or 0.0))
    if assistant_model is not None:
        if not isinstance(assistant_model, torch.nn.Module):
            raise TypeError(f"assistant_model must be an HF causal LM in continuous batching (the Engine drafts with "
                            f"draft models and prompt lookup), got {type(assistant_model).__name__}")
        fields["speculative"] = SpeculativeConfig(method="draft", draft_model=assistant_model,
                                                  num_tokens=min(int(config.num_assistant_tokens or 4), 15))
    elif config.prompt_lookup_num_tokens is not None:
        fields["speculative"] = SpeculativeConfig(num_tokens=min(int(config.prompt_lookup_num_tokens), 15),
                                                  max_ngram=int(config.max_matching_ngram_size or 2))
    SamplingParams(max_new_tokens=1, **fields)
    return fields


def eos_ids(eos) -> tuple[int, ...]:
    """HF's eos ids as stop ids: None or negative ids disable eos."""
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return tuple(int(t) for t in ids if int(t) >= 0)
