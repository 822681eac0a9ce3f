"""Every family: llmplug greedy output token-identical to stock HF generate in fp32 on batched prompts."""

import pytest
import torch

import llmplug
from llmplug.ops._triton import cpu_kernels
from llmplug.patches.decoder import FusedDecoder
from llmplug.state import state_of
from tests.tiny_models import FUSED, GENERIC, make_model, pad, prompts

FAMILIES = sorted(FUSED) + sorted(GENERIC)


def _generate(model, ids, mask, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_stock_hf(family):
    model = make_model(family)
    ids, mask = pad(prompts(4, lengths=(5, 13, 2, 8)))
    expected = _generate(model, ids, mask)
    llmplug.optimize(model)
    assert isinstance(state_of(model).runner.forward_fn, FusedDecoder) == (family in FUSED)
    with cpu_kernels(False):
        got = _generate(model, ids, mask)
    assert torch.equal(got, expected)
    assert len(set(got[:, ids.shape[1]:].flatten().tolist())) > 3, "degenerate model output: test cannot fail"


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_with_interpreted_kernels(family):
    """The same check with the Triton kernels (interpreted) instead of the references."""
    model = make_model(family)
    ids, mask = pad(prompts(3, lengths=(5, 9, 2)))
    expected = _generate(model, ids, mask)
    llmplug.optimize(model)
    with cpu_kernels(True):
        got = _generate(model, ids, mask)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_chunked_prefill_and_tiny_pages(family):
    """Prompts split across prefill chunks and many small pages still give stock HF's tokens."""
    model = make_model(family)
    ids, mask = pad(prompts(3, lengths=(21, 9, 30)))
    expected = _generate(model, ids, mask)
    llmplug.optimize(model, max_prefill_tokens=7, kv_block_size=8)
    with cpu_kernels(False):
        assert torch.equal(_generate(model, ids, mask), expected)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_unoptimize_restores_bit_identical_logits(family):
    model = make_model(family)
    ids, mask = pad(prompts(2))
    before = model(input_ids=ids, attention_mask=mask).logits
    params = {n: p for n, p in model.named_parameters()}
    data = {n: p.detach().clone() for n, p in params.items()}
    llmplug.optimize(model)
    with cpu_kernels(False):
        _generate(model, ids, mask)
    llmplug.unoptimize(model)
    assert not llmplug.is_optimized(model)
    assert "generate" not in model.__dict__
    for n, p in model.named_parameters():
        assert p is params[n] and p.is_contiguous() and torch.equal(p, data[n]), n
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)


def test_optimize_twice_is_a_no_op_and_other_models_untouched():
    model, other = make_model("llama"), make_model("llama")
    assert llmplug.optimize(model) is model
    runner = state_of(model).runner
    llmplug.optimize(model)
    assert state_of(model).runner is runner
    assert not llmplug.is_optimized(other) and "generate" not in other.__dict__
    with pytest.raises(ValueError, match="different config"):
        llmplug.optimize(model, kv_block_size=32)


def test_stock_forward_still_works_after_optimize():
    model = make_model("qwen3")
    ids, mask = pad(prompts(2))
    before = model(input_ids=ids, attention_mask=mask).logits
    llmplug.optimize(model)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, before)


def test_unsupported_model_raises():
    import transformers as tf

    model = tf.AutoModelForSeq2SeqLM.from_config(tf.T5Config(vocab_size=64, d_model=32, num_layers=1, num_heads=2,
                                                             d_ff=64, d_kv=16))
    with pytest.raises(llmplug.UnsupportedModelError, match="model_type='t5'"):
        llmplug.optimize(model)


def test_bad_options_raise():
    model = make_model("llama")
    with pytest.raises(TypeError, match="kv_blok_size"):
        llmplug.optimize(model, kv_blok_size=16)
    with pytest.raises(ValueError, match="kv_block_size=12"):
        llmplug.optimize(model, kv_block_size=12)
    assert not llmplug.is_optimized(model)


ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rope_types_match_stock_hf(rope):
    import transformers as tf

    from tests.tiny_models import COMMON

    config = tf.LlamaConfig(**{**COMMON, "max_position_embeddings": 64},
                            rope_parameters={**ROPES[rope], "rope_theta": 10000.0})
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    ids, mask = pad(prompts(2, lengths=(40, 70)))  # past the original context, where scaling matters
    expected = _generate(model, ids, mask)
    llmplug.optimize(model, max_model_len=128)
    with cpu_kernels(False):
        assert torch.equal(_generate(model, ids, mask), expected)
