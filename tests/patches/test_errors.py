"""What ``optimize`` says about things it cannot run: the value passed, why, and what to load instead."""

import pytest
import torch
import transformers as tf

import llmplug
from tests.tiny_models import COMMON, FUSED, MULTIMODAL


@pytest.mark.parametrize("fn", [llmplug.optimize, llmplug.unoptimize, llmplug.is_optimized])
def test_checkpoint_name_raises_type_error(fn):
    with pytest.raises(TypeError,
                       match=r"got str 'gpt2'; load it first, .*AutoModelForCausalLM\.from_pretrained\('gpt2'\)"):
        fn("gpt2")


def test_other_non_module_raises_type_error():
    with pytest.raises(TypeError, match=r"got dict \{'model': 1\}; load it first"):
        llmplug.optimize({"model": 1})


@pytest.mark.parametrize("config, causal_lm", [
    (FUSED["llama"], "LlamaForCausalLM"),
    (MULTIMODAL["gemma3"], "Gemma3ForConditionalGeneration"),  # AutoModel gives the wrapper's base, Gemma3Model
], ids=["llama", "gemma3"])
def test_base_model_without_lm_head(config, causal_lm):
    """What ``AutoModel.from_pretrained`` loads: a supported family, but no head to generate with."""
    model = tf.AutoModel.from_config(config())
    with pytest.raises(llmplug.UnsupportedModelError) as err:
        llmplug.optimize(model)
    msg = str(err.value)
    assert f"{type(model).__name__} (model_type={model.config.model_type!r}) has no language-model head" in msg
    assert "AutoModelForCausalLM.from_pretrained" in msg and causal_lm in msg
    assert "not supported" not in msg and "cannot run" not in msg


def test_model_of_a_type_without_causal_lm():
    model = tf.T5EncoderModel(tf.T5Config(vocab_size=64, d_model=32, num_layers=1, num_heads=2, d_ff=64, d_kv=16))
    with pytest.raises(llmplug.UnsupportedModelError,
                       match=r"T5EncoderModel \(model_type='t5'\) has no language-model head.*no causal LM class"):
        llmplug.optimize(model)


def test_plain_torch_module():
    with pytest.raises(llmplug.UnsupportedModelError, match="Linear has no transformers config"):
        llmplug.optimize(torch.nn.Linear(4, 4))


def test_wrapper_with_its_own_generate_is_refused():
    """Kosmos-2's generate runs its vision model first; llmplug's would skip it and call a forward that needs the
    image, so optimize refuses the model instead of leaving generate to crash."""
    config = tf.Kosmos2Config(
        text_config=dict(vocab_size=COMMON["vocab_size"], embed_dim=32, layers=1, attention_heads=2, ffn_dim=64),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        latent_query_num=4)
    model = tf.Kosmos2ForConditionalGeneration(config).eval()
    with pytest.raises(llmplug.UnsupportedModelError,
                       match=r"cannot run Kosmos2ForConditionalGeneration \(model_type='kosmos-2'\): .* has its own "
                             "generate"):
        llmplug.optimize(model)
    assert not llmplug.is_optimized(model)
