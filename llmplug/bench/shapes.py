"""Named model shapes built with random weights (speed does not depend on weight values), or a local path."""

from __future__ import annotations

import os

import torch
import transformers as tf

from ..loading import load_causal_lm

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

SHAPES = {
    "tiny-llama": lambda: tf.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
    "llama-1b": lambda: tf.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                       head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True,
                                       rope_parameters=_LLAMA3_ROPE),
    "llama-8b": lambda: tf.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                       max_position_embeddings=131072, rope_parameters=_LLAMA3_ROPE),
    "llama-70b": lambda: tf.LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                        max_position_embeddings=131072, rope_parameters=_LLAMA3_ROPE),
    "qwen3-8b": lambda: tf.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                       num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                       head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0),
}


def build(name: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A model of a named shape with random weights, or ``from_pretrained`` of a local directory."""
    if os.path.isdir(name):
        model = load_causal_lm(name, device, dtype=dtype)
    elif name in SHAPES:
        with torch.device(device):
            model = tf.AutoModelForCausalLM.from_config(SHAPES[name](), dtype=dtype)
    else:
        raise ValueError(f"model={name!r} is neither a local directory nor a known shape {sorted(SHAPES)}")
    model.generation_config.eos_token_id = None  # random weights: run every requested token
    model.generation_config.pad_token_id = 0
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step must read: every parameter and persistent buffer once (quantized weights, their scales
    and zero points included; tied tensors counted once; RoPE tables are not weights), and one embedding row per token
    rather than the whole table. On the meta device (no storage) tensors are told apart by identity."""
    saved = [b for m in model.modules() for name, b in m._buffers.items()
             if b is not None and name not in m._non_persistent_buffers_set]
    seen, total = set(), 0
    for t in [*model.parameters(), *saved]:
        if _storage(t) not in seen:
            seen.add(_storage(t))
            total += t.numel() * t.element_size()
    embed = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)  # None for a quantized lm_head
    if head is None or _storage(embed) != _storage(head):
        total -= embed.numel() * embed.element_size()  # only one embedding row per token is read
    return total


def _storage(t: torch.Tensor):
    """What tells shared weights apart: the data pointer, or on the meta device the tensor itself."""
    return id(t) if t.is_meta else t.data_ptr()
