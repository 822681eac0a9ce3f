"""What a user of ``llmplug.Engine`` sees when a request cannot run: an over-long request's message names its length,
the limit, where the limit comes from and how to raise it; a failed ``generate`` closes its progress bar."""

import copy

import pytest

import llmplug
from llmplug import Engine, SamplingParams
from llmplug.engine import serving
from tests.engine.test_engine import make_engine
from tests.tiny_models import make_model, reference_kernels


@pytest.fixture(autouse=True)
def _references():
    with reference_kernels():
        yield


def _message(engine: Engine, prompt: list[int], params: SamplingParams) -> str:
    with pytest.raises(ValueError) as info:
        engine.add_request(prompt, params)
    return str(info.value)


def test_too_long_for_the_models_positions():
    _, engine = make_engine()  # the tiny llama has max_position_embeddings=256
    text = _message(engine, [5] * 250, SamplingParams(max_new_tokens=10))
    assert "request of 260 tokens (prompt 250 + max_new_tokens=10) exceeds max_model_len=256" in text
    assert "the model's max_position_embeddings" in text
    assert "llmplug.optimize(model, max_model_len=...) before building the Engine" in text
    assert "shorten the prompt or max_new_tokens" in text


def test_too_long_for_the_configured_limit():
    model = copy.deepcopy(make_model("llama"))
    llmplug.optimize(model, kv_num_blocks=64, kv_block_size=8, max_model_len=100)
    text = _message(Engine(model), [5] * 95, SamplingParams(max_new_tokens=6))
    assert "request of 101 tokens (prompt 95 + max_new_tokens=6) exceeds max_model_len=100" in text
    assert "set by llmplug.optimize(model, max_model_len=100)" in text and "max_position_embeddings" not in text
    assert "llmplug.unoptimize(model)" in text  # an optimized model is re-optimized only after unoptimize


def test_a_failed_generate_closes_its_progress_bar(monkeypatch):
    bars = []

    class Recorded(serving.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(serving, "tqdm", Recorded)
    _, engine = make_engine()
    with pytest.raises(ValueError, match="max_model_len=256"):
        engine.generate([[5, 6], [5] * 250], SamplingParams(max_new_tokens=10))
    assert len(bars) == 1 and bars[0].disable, "the progress bar was left open"
