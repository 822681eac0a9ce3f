"""Speculative decoding inside the Engine (prompt lookup, greedy requests): every greedy output equals its solo run
without speculation, inside continuous batching with chunked prefill, prefix caching, preemption, aborts and sampled
neighbours; no block leaks (fp32 CPU, references)."""

import random

import pytest
import torch

import llmplug
from llmplug.engine.params import EngineConfig, SamplingParams, SpeculativeConfig
from llmplug.spec.adaptive import RIDGE_TOKENS
from tests.stats import chi_square_p, pair_counts
from tests.tiny_models import make_model, prompts, reference_kernels

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
TEMPERATURE = 4.0  # the copying model's logits are far apart: this spreads its first sample (top prob ~0.35)


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    monkeypatch.setitem(RIDGE_TOKENS, "cpu", 1e9)  # the adaptive draft count as on a GPU (a CPU is compute-bound)
    with reference_kernels():
        yield


def _copying(model):
    """Layers scaled down, LM head tied to the embedding: the model repeats its input, so drafts get accepted."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name and "lm_head" not in name:
                p.mul_(0.01)
    return model


def _models():
    plain = make_model("llama")
    copying = _copying(make_model("llama", tie_word_embeddings=True))
    return plain, copying


def _solo(model, prompt, params):
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=params.max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _echo(n, seed=0):
    return [p + p[:5] for p in prompts(n, lengths=(7, 19, 4, 33, 12), seed=seed)]


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_solo_runs(which, k):
    model = _models()[which]
    stock = [_solo(model, p, GREEDY) for p in _echo(6)]
    llmplug.optimize(model)
    engine = llmplug.Engine(model, EngineConfig(max_num_batched_tokens=32,  # prompts chunked across steps
                                                speculative=SpeculativeConfig(num_tokens=k)))
    outs = engine.generate(_echo(6), GREEDY, progress=False)
    assert [o.outputs[0].token_ids for o in outs] == stock
    spec = engine.stats()["speculation"]
    assert spec["drafted"] > 0
    if which == 1:  # the copying model: prompt lookup predicts it
        assert spec["acceptance_rate"] > 0.8 and spec["tokens_per_verified_row"] > 1.5
    assert engine.blocks.num_used == 0


def drive_with_aborts(engine, ids: list[str], rng: random.Random, rate: float = 0.05) -> dict:
    """Step ``engine`` until every request is done, aborting a random live one of ``ids`` after a step with
    probability ``rate`` -> ``{request id: RequestOutput}``."""
    done, aborted = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        if rng.random() < rate:
            live = [r for r in ids if r not in done and r not in aborted]
            if live:
                victim = rng.choice(live)
                engine.abort(victim)
                aborted.add(victim)
    return done


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_soak_with_preemption_aborts_and_sampled_neighbours(mode):
    """60 requests on a pool too small for them all (preemption), random aborts, sampled and n = 2 requests among
    greedy ones; every finished greedy output equals its solo run and no block leaks."""
    _, model = _models()
    rng = random.Random(0)
    rows = _echo(60, seed=1)
    llmplug.optimize(model, kv_num_blocks=24, kv_block_size=8)
    engine = llmplug.Engine(model, EngineConfig(max_num_batched_tokens=48, preemption_mode=mode, swap_space_gb=0.01,
                                                speculative=SpeculativeConfig()))
    ids, greedy = [], {}
    for i, prompt in enumerate(rows):
        kind = rng.random()
        if kind < 0.2:
            params = SamplingParams(max_new_tokens=12, temperature=0.9, seed=i, n=2 if kind < 0.1 else 1)
        else:
            params = SamplingParams(max_new_tokens=rng.randint(4, 20), temperature=0.0, ignore_eos=True)
        rid = engine.add_request(prompt, params)
        ids.append(rid)
        if params.temperature == 0.0:
            greedy[rid] = (prompt, params)
    done = drive_with_aborts(engine, ids, rng)
    assert engine.scheduler.num_preemptions > 0 and engine.stats()["speculation"]["accepted"] > 0
    assert engine.blocks.num_used == 0
    llmplug.unoptimize(model)
    assert_greedy_equal_solo(model, greedy, done)


def assert_greedy_equal_solo(model, greedy: dict, done: dict) -> None:
    """Every finished (not aborted) greedy request of ``greedy`` (``{id: (prompt, params)}``) equals ``model``'s solo
    greedy run, and more than 20 were checked."""
    checked = 0
    for rid, (prompt, params) in greedy.items():
        out = done[rid]
        if out.outputs[0].finish_reason == "abort":
            continue
        assert out.outputs[0].token_ids == _solo(model, prompt, params), rid
        checked += 1
    assert checked > 20


def test_bad_speculative_config():
    with pytest.raises(ValueError, match="method='eagle'"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_tokens=0"):
        SpeculativeConfig(num_tokens=0)
    with pytest.raises(ValueError, match="speculative="):
        EngineConfig(speculative={"num_tokens": 4})
    with pytest.raises(ValueError, match="adaptive=1"):
        SpeculativeConfig(adaptive=1)


@pytest.mark.parametrize("biased", [False, True])
def test_sampled_requests_are_exact_in_distribution(biased, monkeypatch):
    """3,000 sampled requests of one prompt that ends in a repeat, on a model that likes to repeat, three new tokens:
    the (first, second) pairs follow the model's exact joint distribution after temperature and top-p (chi-square),
    the second coming from verify steps that accept or reject prompt lookup's drafts; a sampler that redraws from p
    after a rejection fails."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    from llmplug.engine import engine_spec
    from tests.spec.test_generate_spec import _biased_rejection

    if biased:
        monkeypatch.setattr(engine_spec, "rejection_sample", _biased_rejection)
    torch.manual_seed(0)  # the model TEMPERATURE was chosen for
    model = _copying(make_model("llama", tie_word_embeddings=True))  # likes to repeat: drafts get accepted
    stock = make_model("llama", tie_word_embeddings=True)
    stock.load_state_dict(model.state_dict())
    prompt = (torch.randperm(125, generator=torch.Generator().manual_seed(3)) + 3).tolist()
    prompt += prompt[-1:]  # a repeat at the end: prompt lookup drafts another one
    llmplug.optimize(model)
    engine = llmplug.Engine(model, EngineConfig(max_num_seqs=512, speculative=SpeculativeConfig(num_tokens=3)))
    n = 3000
    torch.manual_seed(0)
    params = SamplingParams(max_new_tokens=3, temperature=TEMPERATURE, top_p=0.95, ignore_eos=True)
    outs = engine.generate([prompt] * n, params, progress=False)
    assert all(out.error is None for out in outs)
    spec = engine.stats()["speculation"]
    assert spec["drafted"] > 500 and 0 < spec["accepted"] < spec["drafted"]
    warp = LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopPLogitsWarper(0.95)])

    def dist(ids):
        with torch.no_grad():
            logits = stock(input_ids=ids).logits[:, -1].float()
        return torch.softmax(warp(ids, logits), dim=-1)

    ids = torch.tensor([prompt])
    first = dist(ids)[0]
    support = first.nonzero().squeeze(1)
    second = dist(torch.cat([ids.repeat(len(support), 1), support[:, None]], dim=1))
    expected = (first[support, None] * second).reshape(-1) * n
    observed = pair_counts([out.outputs[0].token_ids[:2] for out in outs], support, second.shape[1])
    p_value, cells = chi_square_p(observed, expected)
    assert (p_value < 1e-6) if biased else (p_value > 1e-3), (cells, p_value, spec)


@pytest.mark.parametrize("which", [0, 1])
def test_generate_batch_speculates_with_prompt_lookup(which):
    """``generate_batch`` with ``prompt_lookup_num_tokens`` speculates (stock's ignores it) and every greedy output
    equals stock HF's alone, for prompts of different lengths; a later call without it does not speculate."""
    from transformers import GenerationConfig

    model = _models()[which]
    rows = _echo(5)
    stock = [_solo(model, p, GREEDY) for p in rows]
    llmplug.optimize(model)
    config = GenerationConfig(max_new_tokens=GREEDY.max_new_tokens, do_sample=False, eos_token_id=None,
                              prompt_lookup_num_tokens=3, max_matching_ngram_size=3)
    res = model.generate_batch(rows, config)
    assert [res[f"req_{i}"].generated_tokens for i in range(len(rows))] == stock
    engine = llmplug.state.state_of(model).engine
    spec = engine.stats()["speculation"]
    assert spec["drafted"] > 0
    if which == 1:
        assert spec["acceptance_rate"] > 0.8
    engine.reset_stats()
    config.prompt_lookup_num_tokens = None
    res = model.generate_batch(rows, config)
    assert [res[f"req_{i}"].generated_tokens for i in range(len(rows))] == stock
    assert "speculation" not in engine.stats() and engine.blocks.num_used == 0


def test_one_request_speculates_beside_others():
    """``SamplingParams(speculative=...)`` makes one request speculate in an engine without a default; its neighbour
    does not, and both equal their solo runs."""
    _, model = _models()
    rows = _echo(2)
    stock = [_solo(model, p, GREEDY) for p in rows]
    llmplug.optimize(model)
    engine = llmplug.Engine(model)
    spec = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, speculative=SpeculativeConfig())
    alone = engine.generate(rows[:1], spec, progress=False)[0].outputs[0]
    first = engine.stats()["speculation"]
    engine.reset_stats()
    outs = engine.generate(rows, [spec, GREEDY], progress=False)
    assert [o.outputs[0].token_ids for o in outs] == stock and alone.token_ids == stock[0]
    assert first["accepted"] > 0 and engine.stats()["speculation"] == first  # the neighbour drafted nothing
    own = outs[0].outputs[0].speculation  # the request's own counters equal the engine's over this call
    assert own == alone.speculation and outs[1].outputs[0].speculation is None
    assert own == first and own["tokens_per_verified_row"] > 1.5
    assert engine.speculation.live == 0 and not engine.speculation.active()  # no speculating request left
    with pytest.raises(ValueError, match="speculative=4"):
        SamplingParams(speculative=4)


@pytest.mark.parametrize("which", [0, 1])
def test_adaptive_draft_count_follows_acceptance(which):
    """With ``adaptive`` (the default) each request's draft count follows its own acceptance: a random model accepts
    next to nothing, so its requests stop drafting (a probe now and then) and draft far less than with a fixed count;
    the copying model accepts, so its requests keep drafting. Outputs equal the solo runs either way."""
    model = _models()[which]
    stock = [_solo(model, p, GREEDY) for p in _echo(6)]
    llmplug.optimize(model)
    drafted = {}
    for adaptive in (False, True):
        engine = llmplug.Engine(model, EngineConfig(speculative=SpeculativeConfig(adaptive=adaptive)))
        outs = engine.generate(_echo(6), GREEDY, progress=False)
        assert [o.outputs[0].token_ids for o in outs] == stock
        drafted[adaptive] = engine.stats()["speculation"]["drafted"]
        engine.stop()
    if which == 0:
        assert 0 < drafted[True] < drafted[False] / 2
    else:
        assert drafted[True] > 0.8 * drafted[False]


def test_adaptive_draft_count_on_a_cpu(monkeypatch):
    """On a CPU's own estimate (compute-bound from a few tokens) six decoding rows are not worth drafting for."""
    monkeypatch.setitem(RIDGE_TOKENS, "cpu", 4.0)
    _, model = _models()
    llmplug.optimize(model)
    engine = llmplug.Engine(model, EngineConfig(speculative=SpeculativeConfig()))
    engine.generate(_echo(6), GREEDY, progress=False)
    fixed = llmplug.Engine(model, EngineConfig(speculative=SpeculativeConfig(adaptive=False)))
    fixed.generate(_echo(6), GREEDY, progress=False)
    assert engine.stats()["speculation"]["drafted"] < fixed.stats()["speculation"]["drafted"] / 2


def test_fillers_make_all_drafting_steps_uniform(monkeypatch):
    """Where graphs replay (forced here on the CPU), a step whose rows all draft pads the shorter drafts with filler
    tokens so every row verifies the same count (a uniform step, one CUDA graph): fillers are never accepted, their
    pages go back, and every greedy output still equals its solo run. A copy of the model as the draft model drafts 4
    tokens a step until a row nears its own max_new_tokens, where it drafts fewer than its neighbours."""
    import copy

    from llmplug.engine import engine_spec

    monkeypatch.setattr(engine_spec.EngineSpeculation, "_graphed", lambda self, rows: True)
    filled = []
    fill = engine_spec.EngineSpeculation._fill
    monkeypatch.setattr(engine_spec.EngineSpeculation, "_fill",
                        lambda self, plan, drafts: filled.append(fill(self, plan, drafts)) or filled[-1])
    _, model = _models()
    rows = _echo(6)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 13, 18, 22, 24, 11)]
    stock = [_solo(model, p, sp) for p, sp in zip(rows, params)]
    draft = copy.deepcopy(model)
    llmplug.optimize(model)
    spec = SpeculativeConfig(method="draft", draft_model=draft, adaptive=False)
    engine = llmplug.Engine(model, EngineConfig(speculative=spec))
    outs = engine.generate(rows, params, progress=False)
    assert [o.outputs[0].token_ids for o in outs] == stock
    assert any(sum(f) > 0 for f in filled)  # some steps padded shorter drafts
    assert engine.blocks.num_used == 0
