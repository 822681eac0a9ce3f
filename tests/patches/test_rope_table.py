import pytest
import torch

import llmplug
from llmplug.state import state_of
from tests.tiny_models import make_model


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_rope_table_rows_equal_the_rotary_module(family):
    """cos/sin gathered from the once-filled table equal HF's rotary module on the same positions, bit for bit."""
    model = make_model(family)
    llmplug.optimize(model)
    runner = state_of(model).runner
    decoder = runner.forward_fn
    hidden = torch.zeros(4, model.config.hidden_size)
    positions = torch.tensor([0, 5, 255, 17])
    gathered = decoder._rotary(hidden, positions, runner)
    assert runner.max_model_len == 256 and decoder._rope_tables  # the table path was taken
    direct = decoder._rotary_emb(hidden, positions)
    assert gathered.keys() == direct.keys()
    for key, (cos, sin) in direct.items():
        assert torch.equal(gathered[key][0], cos) and torch.equal(gathered[key][1], sin)


def test_position_dependent_rope_types_keep_the_module():
    import transformers as tf

    from tests.tiny_models import COMMON

    config = tf.LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    llmplug.optimize(model)
    runner = state_of(model).runner
    cos, sin = runner.forward_fn._rotary(torch.zeros(2, 64), torch.tensor([3, 4]), runner)[None]
    assert not runner.rope_by_position and runner.forward_fn._rope_tables == {}  # the module, every step
    assert cos.shape == sin.shape == (2, 64 // 4)
