"""EAGLE-3 heads inside the Engine (``SpeculativeConfig(method="eagle3", head=...)``): every greedy output equals its
solo run with chunked prefill, prefix-cache hits and preemption; the committed head drafts well for the shipped model
(fp32 CPU, references)."""

import random

import pytest
import torch

import llmplug
from llmplug.engine.params import EngineConfig, SamplingParams, SpeculativeConfig
from llmplug.spec.adaptive import RIDGE_TOKENS
from llmplug.state import state_of
from tests.engine.test_engine_spec import assert_greedy_equal_solo, drive_with_aborts
from tests.spec.test_eagle3 import COMMITTED, _head_config, _head_tensors, _save, _target
from tests.tiny_models import prompts, reference_kernels

GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    monkeypatch.setitem(RIDGE_TOKENS, "cpu", 1e9)  # the adaptive draft count as on a GPU
    with reference_kernels():
        yield


def _solo(model, prompt, params):
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=params.max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _setup(tmp_path, **config):
    """A tiny target, its solo greedy runs of six prompts, and an Engine drafting with a random head."""
    model = _target()
    rows = prompts(6, lengths=(7, 19, 4, 45, 12), seed=2)
    stock = [_solo(model, p, GREEDY) for p in rows]
    llmplug.optimize(model)
    head = llmplug.load_eagle3(_save(tmp_path / "head", _head_config(), _head_tensors(_head_config())), model)
    spec = SpeculativeConfig(method="eagle3", head=head, adaptive=False)
    return model, rows, stock, head, llmplug.Engine(model, EngineConfig(speculative=spec, **config))


def test_greedy_equals_solo_runs(tmp_path):
    """A random head (it drafts, the model rarely agrees), prompts chunked across steps: outputs equal solo runs, the
    model's layer inputs are captured, every row is dropped at the end."""
    model, rows, stock, head, engine = _setup(tmp_path, max_num_batched_tokens=32)
    outs = engine.generate(rows, GREEDY, progress=False)
    assert [o.outputs[0].token_ids for o in outs] == stock
    assert engine.stats()["speculation"]["drafted"] > 0
    assert state_of(model).runner.aux_layers == tuple(head.aux_layers)
    eagle = engine.speculation.drafters[head]
    assert not eagle.rows and not eagle.lost and engine.blocks.num_used == 0


def test_prefix_cache_hit_goes_without_drafts(tmp_path):
    """A prompt whose first blocks come from the prefix cache has no layer inputs for them: that request drafts
    nothing, and still gives its solo run's tokens."""
    _, rows, stock, _, engine = _setup(tmp_path)
    first = engine.generate(rows[3:4], GREEDY, progress=False)[0].outputs[0]
    again = engine.generate(rows[3:4], GREEDY, progress=False)[0].outputs[0]
    assert first.token_ids == again.token_ids == stock[3]
    assert first.speculation["drafted"] > 0 and again.speculation["drafted"] == 0
    assert engine.blocks.stats.hit_tokens > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_aborts(tmp_path, mode):
    """A pool too small for every request (preemption drops a row; a recomputed prompt starts a new one, a swapped-in
    one goes without drafts), random aborts: greedy outputs equal solo runs, no block or row is left."""
    model = _target()
    rng = random.Random(0)
    llmplug.optimize(model, kv_num_blocks=20, kv_block_size=8)
    head = llmplug.load_eagle3(_save(tmp_path / "head", _head_config(), _head_tensors(_head_config())), model)
    spec = SpeculativeConfig(method="eagle3", head=head, adaptive=False)
    engine = llmplug.Engine(model, EngineConfig(max_num_batched_tokens=48, preemption_mode=mode, swap_space_gb=0.01,
                                                speculative=spec))
    greedy, ids = {}, []
    for prompt in prompts(30, lengths=(7, 19, 4, 33, 12), seed=5):
        params = SamplingParams(max_new_tokens=rng.randint(4, 20), temperature=0.0, ignore_eos=True)
        rid = engine.add_request(prompt, params)
        ids.append(rid)
        greedy[rid] = (prompt, params)
    done = drive_with_aborts(engine, ids, rng)
    assert engine.scheduler.num_preemptions > 0 and engine.stats()["speculation"]["drafted"] > 0
    eagle = engine.speculation.drafters[head]
    assert engine.blocks.num_used == 0 and not eagle.rows and not eagle.lost
    llmplug.unoptimize(model)
    assert_greedy_equal_solo(model, greedy, done)


@pytest.mark.skipif(not COMMITTED.is_dir(), reason="models/ is not in this checkout")
def test_committed_head_in_the_engine():
    """The trained head drafts for the shipped model inside the Engine as well as in generate: greedy tokens equal
    plain greedy, most drafts accepted."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = COMMITTED.parent / "llmplug-stdlib-small"
    model = llmplug.optimize(AutoModelForCausalLM.from_pretrained(path))
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["def read_lines(path):\n    with open(", "import os\n\n\ndef list_files(path):\n"]
    ids = [tok(t)["input_ids"] for t in texts]
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llmplug.Engine(model).generate(ids, params, progress=False)]
    spec = SpeculativeConfig(method="eagle3", head=llmplug.load_eagle3(COMMITTED, model), num_tokens=4)
    engine = llmplug.Engine(model, EngineConfig(speculative=spec, enable_prefix_caching=False))
    outs = engine.generate(ids, params, progress=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = engine.stats()["speculation"]
    assert stats["acceptance_rate"] > 0.5 and stats["tokens_per_verified_row"] > 2.0, stats


def test_bad_eagle3_configs(tmp_path):
    with pytest.raises(ValueError, match="method='eagle3' needs head="):
        SpeculativeConfig(method="eagle3")
    with pytest.raises(ValueError, match="head is only for method='eagle3'"):
        SpeculativeConfig(head=object())
