"""``generate`` hands back and honours HF's state as stock does: the returned cache, cache implementations, compile
options, autocast, and no deprecation noise (fp32 CPU, reference kernels)."""

import pytest
import torch
from transformers import CompileConfig, DynamicCache, StaticCache
from transformers.utils import generic as hf_generic

import llmplug
from llmplug.engine import generate as generate_module
from llmplug.engine.hf_cache import CACHE_FIELD, token_columns
from llmplug.ops._triton import cpu_kernels
from llmplug.state import state_of
from tests.engine.test_generate import _pair
from tests.tiny_models import make_model, pad, prompts


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    monkeypatch.setattr(generate_module, "_warned", set())  # every fallback warns in every test
    with cpu_kernels(False):
        yield


def test_token_columns_follow_stock_padded_layout():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0, 1]])
    cols = token_columns(mask, 3, 4, 6)
    assert cols.tolist() == [[-1, -1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [-1, 0, -1, 1, 2, 3]]
    assert token_columns(None, 2, 3, 4).tolist() == [[0, 1, 2, 3]] * 2


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_returned_cache_is_stock_and_continues_the_conversation(family):
    """The returned cache holds stock's KV at every real column (sliding-window layers keep the same tail), and a
    continuation from it gives stock's tokens (it runs on stock generate, with llmplug's one-time warning)."""
    stock, fast = _pair(family)
    ids, mask = pad(prompts(3, lengths=(5, 11, 3)))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    a, b = stock.generate(**kw), fast.generate(**kw)
    assert torch.equal(a.sequences, b.sequences)
    ca, cb = getattr(a, CACHE_FIELD), getattr(b, CACHE_FIELD)
    assert type(ca) is type(cb) is DynamicCache
    assert cb.get_seq_length() == ca.get_seq_length() == a.sequences.shape[1] - 1
    full_mask = torch.cat([mask, torch.ones(3, a.sequences.shape[1] - 1 - mask.shape[1], dtype=mask.dtype)], 1)
    for la, lb in zip(ca.layers, cb.layers):
        assert type(la) is type(lb) and la.keys.shape == lb.keys.shape
        real = full_mask[:, -la.keys.shape[2]:].bool()
        for x, y in ((la.keys, lb.keys), (la.values, lb.values)):
            torch.testing.assert_close(y.transpose(1, 2)[real], x.transpose(1, 2)[real], rtol=1e-5, atol=1e-5)
    more = torch.tensor([[7, 8]] * 3)
    follow = dict(input_ids=torch.cat([a.sequences, more], 1),
                  attention_mask=torch.cat([full_mask, torch.ones(3, 3, dtype=mask.dtype)], 1),
                  max_new_tokens=5, do_sample=False)
    c = stock.generate(**follow, **{CACHE_FIELD: ca})
    with pytest.warns(UserWarning, match="running stock transformers generate"):
        d = fast.generate(**follow, **{CACHE_FIELD: cb})
    assert torch.equal(c, d)


def test_use_cache_false_returns_no_cache():
    _, fast = _pair()
    out = fast.generate(input_ids=torch.tensor([prompts(1)[0]]), max_new_tokens=3, return_dict_in_generate=True,
                        use_cache=False)
    assert getattr(out, CACHE_FIELD) is None and out.sequences.shape[1] == len(prompts(1)[0]) + 3


def test_static_cache_implementation_runs_stock():
    stock, fast = _pair()
    ids, mask = pad(prompts(2))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
              cache_implementation="static")
    a = stock.generate(**kw)
    with pytest.warns(UserWarning, match="cache_implementation='static'"):
        b = fast.generate(**kw)
    assert torch.equal(a.sequences, b.sequences)
    assert isinstance(getattr(b, CACHE_FIELD), StaticCache)


def test_compile_config_without_static_cache_is_named():
    """Stock skips compile_config without a static cache (with a warning); llmplug says it has no effect."""
    stock, fast = _pair()
    ids = torch.tensor([prompts(1)[0]])
    kw = dict(input_ids=ids, max_new_tokens=4, do_sample=False, compile_config=CompileConfig())
    a = stock.generate(**kw)
    with pytest.warns(UserWarning, match="compile_config has no effect"):
        b = fast.generate(**kw)
    assert torch.equal(a, b)


def test_autocast_to_another_dtype_runs_stock():
    """lm-eval-harness's mixed_precision_dtype: an fp32 model under bf16 autocast runs (on stock), as stock does."""
    stock, fast = _pair()
    ids, mask = pad(prompts(2))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = stock.generate(**kw)
        with pytest.warns(UserWarning, match="torch.autocast"):
            b = fast.generate(**kw)
    assert torch.equal(a, b)


def test_autocast_to_the_model_dtype_stays_on_llmplug():
    fast = llmplug.optimize(make_model("llama", dtype=torch.bfloat16))
    ids, mask = pad(prompts(2))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b = fast.generate(**kw)
    assert not generate_module._warned
    assert torch.equal(fast.generate(**kw), b)


def test_return_dict_prints_no_deprecation(monkeypatch):
    """Stock's return dict names the cache field as its transformers version does; so does llmplug's (a wrong name
    makes transformers log that ``past_key_values`` is deprecated)."""
    logged = []
    monkeypatch.setattr(hf_generic.logger, "warning_once", lambda msg, *a, **k: logged.append(msg))
    _, fast = _pair()
    out = fast.generate(input_ids=torch.tensor([prompts(1)[0]]), max_new_tokens=3, return_dict_in_generate=True)
    assert out.sequences.shape[1] == len(prompts(1)[0]) + 3
    assert not [m for m in logged if "deprecated" in m]


def test_a_model_moved_after_optimize_is_optimized_again_where_it_is():
    """``pipeline`` puts a CPU model on the GPU when one exists, users call ``.to``: the fused weights and the KV pool
    must follow (here fp32 -> bf16, what a CPU machine can move between): the tokens of a model optimized there."""
    stock, fast = _pair()
    ids, mask = pad(prompts(2))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    fresh = llmplug.optimize(stock.to(torch.bfloat16))
    fast.to(torch.bfloat16)
    with pytest.warns(UserWarning, match="moved after llmplug.optimize"):
        b = fast.generate(**kw)
    assert torch.equal(fresh.generate(**kw), b)
    assert state_of(fast).runner.dtype == torch.bfloat16 and llmplug.is_optimized(fast)


def test_generate_batch_follows_a_moved_model_too():
    from transformers import GenerationConfig

    stock, fast = _pair()
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    fast.generate_batch(prompts(2), config)  # its engine exists on fp32 weights
    fresh = llmplug.optimize(stock.to(torch.bfloat16))
    fast.to(torch.bfloat16)
    with pytest.warns(UserWarning, match="moved after llmplug.optimize"):
        got = fast.generate_batch(prompts(2), config)
    want = fresh.generate_batch(prompts(2), config)
    assert [got[k].generated_tokens for k in sorted(got)] == [want[k].generated_tokens for k in sorted(want)]
    assert state_of(fast).engine.runner.dtype == torch.bfloat16
