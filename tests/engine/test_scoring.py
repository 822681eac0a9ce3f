"""``llmplug.logits``: each row's logits as the model's own forward gives them for that row alone (fp32 CPU,
references)."""

import pytest
import torch

import llmplug
from llmplug.ops._triton import cpu_kernels
from tests.tiny_models import make_model, pad, prompts


@pytest.fixture(autouse=True)
def _references():
    with cpu_kernels(False):
        yield


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("chunk", [8192, 7])  # 7: every prompt split over prefill steps that continue from the pages
def test_logits_equal_the_models_forward(family, side, chunk):
    stock = make_model(family)
    fast = make_model(family)
    fast.load_state_dict(stock.state_dict())
    stock.set_attn_implementation("eager")  # the reference: transformers 5.17's default sdpa drops Gemma 2's softcap
    llmplug.optimize(fast, max_prefill_tokens=chunk)
    ids, mask = pad(prompts(3, lengths=(5, 17, 9)), side=side)
    got = llmplug.logits(fast, ids, mask)
    real = mask.bool()
    assert got.shape == (*ids.shape, 128) and torch.equal(got[~real], torch.zeros_like(got[~real]))
    for row, m, out in zip(ids, real, got):  # positions count from each row's first real token, as in generate
        torch.testing.assert_close(out[m], stock(input_ids=row[m][None]).logits[0], rtol=1e-4, atol=1e-4)
    one = llmplug.logits(fast, ids[1][real[1]])
    torch.testing.assert_close(one, got[1][real[1]], rtol=1e-4, atol=1e-4)
    assert fast._llmplug.runner.cache.allocator.num_free == fast._llmplug.runner.cache.num_blocks  # pages returned


def test_logits_errors():
    fast = llmplug.optimize(make_model("llama"))
    with pytest.raises(ValueError, match="must be"):
        llmplug.logits(fast, torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="empty prompt"):
        llmplug.logits(fast, torch.tensor([[5, 6], [0, 0]]), torch.tensor([[1, 1], [0, 0]]))
    with pytest.raises(RuntimeError, match="not optimized"):
        llmplug.logits(make_model("llama"), torch.tensor([[5, 6]]))
