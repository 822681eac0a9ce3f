"""The Engine speculating with a draft model (``SpeculativeConfig(method="draft", draft_model=...)``): every greedy
output equals its solo run, inside continuous batching with chunked prefill (and chunked draft catch-up), preemption
(recompute and swap), aborts and sampled and ``n = 2`` neighbours; no page leaks in the target's pool or the draft's
(fp32 CPU, references)."""

import copy
import random

import pytest
import torch

import llmplug
from llmplug.engine.params import EngineConfig, SamplingParams, SpeculativeConfig
from llmplug.spec.adaptive import RIDGE_TOKENS
from llmplug.state import state_of
from tests.engine.test_engine_spec import assert_greedy_equal_solo, drive_with_aborts
from tests.tiny_models import make_model, prompts, reference_kernels

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    monkeypatch.setitem(RIDGE_TOKENS, "cpu", 1e9)  # the adaptive draft count as on a GPU (a CPU is compute-bound)
    with reference_kernels():
        yield


def _target():
    """A two-layer model whose second layer is scaled down, so a one-layer draft agrees with it often, not always."""
    model = make_model("llama")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers.1." in name and p.dim() >= 2:
                p.mul_(0.5)
    return model


def _drafts(target):
    """(a) a copy of the target (every draft accepted); (b) the target without its second layer: a different, smaller
    model (partial acceptance), with its own page size."""
    same = copy.deepcopy(target)
    small = make_model("llama", num_hidden_layers=1)
    small.load_state_dict({k: v for k, v in target.state_dict().items() if "layers.1." not in k})
    llmplug.optimize(small, kv_block_size=8, kv_num_blocks=64)
    return same, small


def _draft_pool(draft):
    return state_of(draft).runner.cache.blocks


def _solo(model, prompt, params):
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=params.max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _rows(n, seed=0):
    return prompts(n, lengths=(7, 19, 4, 45, 12), seed=seed)


@pytest.mark.parametrize("which", ["copy", "smaller"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_solo_runs(which, k):
    """Batched prompts of different lengths, prefill chunked across steps (a 45-token prompt's draft catch-up too)."""
    torch.manual_seed(0)
    model = _target()
    draft = _drafts(model)[which == "smaller"]
    rows = _rows(6)
    stock = [_solo(model, p, GREEDY) for p in rows]
    llmplug.optimize(model)
    spec = SpeculativeConfig(method="draft", draft_model=draft, num_tokens=k)
    engine = llmplug.Engine(model, EngineConfig(max_num_batched_tokens=32, speculative=spec))
    outs = engine.generate(rows, GREEDY, progress=False)
    assert [o.outputs[0].token_ids for o in outs] == stock
    stats = engine.stats()["speculation"]
    assert stats["drafted"] > 0
    if which == "copy":  # the target's own greedy tokens
        assert stats["acceptance_rate"] == 1.0 and stats["tokens_per_verified_row"] > 1.5
    else:
        assert 0.2 < stats["acceptance_rate"] < 1.0
    assert engine.blocks.num_used == 0 and _draft_pool(draft).num_used == 0
    assert not engine.speculation.drafters[draft].rows


def test_draft_pool_too_small_drafts_nothing_and_fails_nothing():
    """A draft pool of one page holds no row's tokens: no drafts, nothing fails, outputs equal solo runs."""
    torch.manual_seed(0)
    model = _target()
    draft = make_model("llama", num_hidden_layers=1)
    llmplug.optimize(draft, kv_block_size=8, kv_num_blocks=1)
    rows = prompts(4, lengths=(12, 19, 9, 45))
    stock = [_solo(model, p, GREEDY) for p in rows]
    llmplug.optimize(model)
    engine = llmplug.Engine(model, EngineConfig(speculative=SpeculativeConfig(method="draft", draft_model=draft)))
    outs = engine.generate(rows, GREEDY, progress=False)
    assert [o.outputs[0].token_ids for o in outs] == stock and all(o.error is None for o in outs)
    assert engine.stats()["speculation"]["drafted"] == 0
    assert engine.blocks.num_used == 0 and _draft_pool(draft).num_used == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_soak_with_preemption_aborts_and_sampled_neighbours(mode):
    """60 requests on target and draft pools too small for them all (preemption; rows the draft pool cannot hold go
    without drafts), random aborts, sampled and n = 2 requests among greedy ones: every finished greedy output equals
    its solo run, every other request finishes, and neither pool leaks a page."""
    torch.manual_seed(0)
    model = _target()
    draft = make_model("llama", num_hidden_layers=1)
    draft.load_state_dict({k: v for k, v in model.state_dict().items() if "layers.1." not in k})
    llmplug.optimize(draft, kv_block_size=8, kv_num_blocks=16)
    rng = random.Random(0)
    rows = _rows(60, seed=1)
    llmplug.optimize(model, kv_num_blocks=24, kv_block_size=8)
    spec = SpeculativeConfig(method="draft", draft_model=draft, num_tokens=3)
    engine = llmplug.Engine(model, EngineConfig(max_num_batched_tokens=48, preemption_mode=mode, swap_space_gb=0.01,
                                                speculative=spec))
    ids, greedy, sampled = [], {}, {}
    for i, prompt in enumerate(rows):
        kind = rng.random()
        if kind < 0.2:
            params = SamplingParams(max_new_tokens=12, temperature=0.9, seed=i, n=2 if kind < 0.1 else 1,
                                    ignore_eos=True)
        else:
            params = SamplingParams(max_new_tokens=rng.randint(4, 20), temperature=0.0, ignore_eos=True)
        rid = engine.add_request(prompt, params)
        ids.append(rid)
        (greedy if params.temperature == 0.0 else sampled)[rid] = (prompt, params)
    done = drive_with_aborts(engine, ids, rng)
    stats = engine.stats()["speculation"]
    assert engine.scheduler.num_preemptions > 0 and 0 < stats["accepted"] < stats["drafted"]
    assert engine.blocks.num_used == 0 and _draft_pool(draft).num_used == 0
    assert not engine.speculation.drafters[draft].rows
    assert all(out.error is None for out in done.values())
    for rid, (_, params) in sampled.items():
        outs = done[rid].outputs
        assert len(outs) == params.n or any(o.finish_reason == "abort" for o in outs)
        assert all(len(o.token_ids) == 12 for o in outs if o.finish_reason != "abort")
    llmplug.unoptimize(model)
    assert_greedy_equal_solo(model, greedy, done)


def test_sampled_requests_verify_greedy_drafts():
    """Sampled requests (seeded, n = 2) verify the draft's greedy tokens by rejection sampling: some are accepted,
    every sample gets its tokens, the same seeds give the same tokens again."""
    torch.manual_seed(0)
    model = _target()
    draft = copy.deepcopy(model)
    llmplug.optimize(model)
    spec = SpeculativeConfig(method="draft", draft_model=draft, adaptive=False)  # drafts every step, accepted or not
    engine = llmplug.Engine(model, EngineConfig(speculative=spec))
    params = SamplingParams(max_new_tokens=16, temperature=0.5, seed=3, n=2, ignore_eos=True)
    first = engine.generate(_rows(3), params, progress=False)
    again = engine.generate(_rows(3), params, progress=False)
    assert all(len(c.token_ids) == 16 for o in first for c in o.outputs) and all(len(o.outputs) == 2 for o in first)
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs] for o in again]
    stats = engine.stats()["speculation"]
    assert stats["accepted"] > 0
    assert engine.blocks.num_used == 0 and _draft_pool(draft).num_used == 0


def test_one_draft_state_per_draft_model():
    """Requests naming their own configs (two k's for one draft model, prompt lookup, none) in one engine: one draft
    state for the model, every output equal to its solo run."""
    torch.manual_seed(0)
    model = _target()
    draft = _drafts(model)[1]
    rows = _rows(4)
    stock = [_solo(model, p, GREEDY) for p in rows]
    llmplug.optimize(model)
    engine = llmplug.Engine(model)
    configs = [SpeculativeConfig(method="draft", draft_model=draft, num_tokens=2),
               SpeculativeConfig(method="draft", draft_model=draft, num_tokens=4), SpeculativeConfig(), None]
    params = [SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, speculative=c) for c in configs]
    outs = engine.generate(rows, params, progress=False)
    assert [o.outputs[0].token_ids for o in outs] == stock
    assert list(engine.speculation.drafters) == [draft] and engine.stats()["speculation"]["accepted"] > 0
    assert engine.blocks.num_used == 0 and _draft_pool(draft).num_used == 0


def test_draft_config_errors_and_identity():
    model = make_model("llama")
    draft = make_model("llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="method='draft' needs draft_model="):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="draft_model is only for method='draft', not method='ngram'"):
        SpeculativeConfig(draft_model=draft)
    with pytest.raises(ValueError, match="draft_model must be an HF causal LM .* got str"):
        SpeculativeConfig(method="draft", draft_model="small-model")
    spec = SpeculativeConfig(method="draft", draft_model=draft)
    assert spec == SpeculativeConfig(method="draft", draft_model=draft) and len({spec, spec}) == 1
    assert spec != SpeculativeConfig(method="draft", draft_model=copy.deepcopy(draft))
    assert copy.deepcopy(SamplingParams(speculative=spec)).speculative.draft_model is draft
    assert repr(spec).endswith("draft_model=<LlamaForCausalLM>, head=None)")
    big = make_model("llama", vocab_size=256)
    bigger = SpeculativeConfig(method="draft", draft_model=big)
    with pytest.raises(ValueError, match="draft_model proposes ids up to 255 but the model embeds only 128"):
        llmplug.Engine(model, EngineConfig(speculative=bigger))
    engine = llmplug.Engine(model)
    with pytest.raises(ValueError, match="draft_model proposes ids up to 255"):
        engine.add_request([5, 6, 7], SamplingParams(speculative=bigger))
    with pytest.raises(ValueError, match="draft_model is the engine's model itself"):
        engine.add_request([5, 6, 7], SamplingParams(speculative=SpeculativeConfig(method="draft", draft_model=model)))
    assert not engine.has_unfinished_requests()


def test_catch_up_keeps_the_shared_prefix():
    """A draft-side row keeps KV for the prefix its fed tokens share with the target's: accepted drafts keep theirs,
    the first rejected one and everything after it go; at least one token is always left to feed."""
    from llmplug.engine.engine_draft import _DraftSeq
    from llmplug.spec.draft import catch_up

    row = _DraftSeq()
    catch_up(row, [5, 6, 7])
    assert (row.tokens, row.num_computed, row.resolved) == ([5, 6, 7], 0, 3)
    row.num_computed, row.tokens = 6, [5, 6, 7, 8, 9, 10]  # fed 7 and drafts 8, 9 (10 was the last draft, not fed)
    catch_up(row, [5, 6, 7, 8, 4])  # 8 accepted, 9 rejected, 4 the target's own
    assert (row.tokens, row.num_computed, row.resolved) == ([5, 6, 7, 8, 4], 4, 5)
    row.num_computed, row.tokens = 7, [5, 6, 7, 8, 4, 1, 2]  # fed 4 and drafts 1, 2 (3 not fed)
    catch_up(row, [5, 6, 7, 8, 4, 1, 2, 3, 9])  # every draft accepted, 9 the target's own
    assert (row.tokens, row.num_computed) == ([5, 6, 7, 8, 4, 1, 2, 3, 9], 7)
    row.num_computed, row.tokens = 9, [5, 6, 7, 8, 4, 1, 2, 3, 9, 1]  # fed 9 and draft 1 (2 not fed)
    catch_up(row, [5, 6, 7, 8, 4, 1, 2, 3, 9, 1])  # a step without drafts emitted 1: all has KV, the last is fed again
    assert (row.tokens, row.num_computed) == ([5, 6, 7, 8, 4, 1, 2, 3, 9, 1], 9)


def test_generate_batch_with_an_assistant_model():
    """``generate_batch(..., assistant_model=draft)`` speculates with the draft model (stock HF's ignores it): every
    greedy output equals stock's alone; a proposer object is refused with a clear error."""
    from transformers import GenerationConfig

    model = _target()
    rows = _rows(5)
    stock = [_solo(model, p, GREEDY) for p in rows]
    _, small = _drafts(model)
    llmplug.optimize(model)
    config = GenerationConfig(max_new_tokens=GREEDY.max_new_tokens, do_sample=False, eos_token_id=None,
                              num_assistant_tokens=3)
    res = model.generate_batch(rows, config, assistant_model=small)
    assert [res[f"req_{i}"].generated_tokens for i in range(len(rows))] == stock
    engine = state_of(model).engine
    assert engine.stats()["speculation"]["accepted"] > 0 and _draft_pool(small).num_used == 0
    with pytest.raises(TypeError, match="assistant_model must be an HF causal LM"):
        model.generate_batch(rows, config, assistant_model=object())
