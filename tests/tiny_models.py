"""Tiny random-weight HF models of every family, built from config classes (no downloads)."""

import contextlib

import torch
import transformers as tf
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from llmplug.ops._triton import cpu_kernels

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)

FUSED = {
    "llama": lambda: tf.LlamaConfig(**COMMON),
    "mistral": lambda: tf.MistralConfig(**COMMON, sliding_window=7),
    "qwen2": lambda: tf.Qwen2Config(**COMMON),
    "qwen3": lambda: tf.Qwen3Config(**COMMON, head_dim=32),
    "gemma": lambda: tf.GemmaConfig(**COMMON, head_dim=16),
    "gemma2": lambda: tf.Gemma2Config(**{**COMMON, "num_hidden_layers": 3}, head_dim=16, sliding_window=6,
                                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                      query_pre_attn_scalar=16),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 3}, head_dim=16, sliding_window=6,
                                               sliding_window_pattern=2, query_pre_attn_scalar=16),
    "phi3": lambda: tf.Phi3Config(**COMMON),
}

GENERIC = {
    "gpt2": lambda: tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0),
    "olmo2": lambda: tf.Olmo2Config(**COMMON),
    "granite": lambda: tf.GraniteConfig(**COMMON, embedding_multiplier=2.0, residual_multiplier=0.5,
                                        attention_multiplier=0.2, logits_scaling=2.0),
}


# Multimodal wrappers around a text stack of one of the families above; ids 125-127 are their image tokens, so
# text-only prompts draw from TEXT_VOCAB. Untied embeddings: a Gemma text stack (embeddings scaled by sqrt(hidden))
# with a tied head predicts each row's last token again and again.
TEXT_VOCAB = 125
IMAGE_TOKENS = dict(boi_token_index=125, eoi_token_index=126, image_token_index=127)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
               patch_size=14)

MULTIMODAL = {
    # what AutoModelForCausalLM loads for gemma-3-4b-it: Gemma3ForConditionalGeneration
    "gemma3": lambda: tf.Gemma3Config(text_config=FUSED["gemma3_text"](),
                                      vision_config=tf.SiglipVisionConfig(**_VISION), mm_tokens_per_image=4,
                                      tie_word_embeddings=False, **IMAGE_TOKENS),
    "llava": lambda: tf.LlavaConfig(text_config=FUSED["llama"](), vision_config=tf.CLIPVisionConfig(**_VISION),
                                    image_token_index=IMAGE_TOKENS["image_token_index"]),
}


def make_model(name: str, dtype=torch.float32, **text) -> torch.nn.Module:
    """A fresh tiny model of family ``name`` (random weights seeded from the global RNG), eval mode.

    ``text`` sets fields of its (text) config. A multimodal wrapper comes from the Auto class a user loads it with:
    ``AutoModelForCausalLM`` where transformers maps its type, else ``AutoModelForImageTextToText``.
    """
    config = {**FUSED, **GENERIC, **MULTIMODAL}[name]()
    for key, value in text.items():
        setattr(config.get_text_config(), key, value)
    auto = tf.AutoModelForCausalLM if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else \
        tf.AutoModelForImageTextToText
    model = auto.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # larger-than-init weights so logits are far from ties and tokens vary
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25)
    return model


def prompts(batch: int, lengths=(5, 11, 3, 8), vocab: int = 128, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(batch)]


def pad(rows: list[list[int]], side: str = "left", pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` padded on ``side``."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, sl] = torch.tensor(r)
        mask[i, sl] = 1
    return ids, mask


@contextlib.contextmanager
def reference_kernels(threads: int = 1):
    """Run models on the ops' references (not the interpreted kernels) with ``threads`` intra-op threads.

    Tiny matmuls on a busy 2-core machine: one thread takes ~50 us where two take milliseconds.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with cpu_kernels(False):
            yield
    finally:
        torch.set_num_threads(before)
