"""Speculative ``generate`` (prompt lookup and a draft model) at any batch size: the tokens of plain greedy decoding,
stock HF's, whatever the proposer (fp32 CPU, references)."""

import copy

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

import llmplug
from llmplug.engine import generate as generate_module
from llmplug.engine import generate_spec
from llmplug.engine.sequences import SequenceBatch
from llmplug.spec import decode as spec_decode
from llmplug.spec.adaptive import AdaptiveK, expected_tokens
from llmplug.spec.proposers import DraftModelProposer
from llmplug.spec.rejection import rejection_sample
from llmplug.state import state_of
from tests.stats import chi_square_p, pair_counts
from tests.tiny_models import make_model, pad, prompts, reference_kernels


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    # as on a GPU, where a step stays weight-bound: speculate at every step (a CPU's cost model would mostly say no)
    monkeypatch.setitem(generate_spec.RIDGE_TOKENS, "cpu", 1e9)
    monkeypatch.setattr(generate_module, "_warned", set())  # each test sees its one-time warnings
    with reference_kernels():
        yield


def _pair(family="llama", **text):
    stock = make_model(family, **text)
    fast = make_model(family, **text)
    fast.load_state_dict(stock.state_dict())
    return stock, llmplug.optimize(fast)


def _echo_prompts(n=4):
    """Prompts that repeat a span, of different lengths, so prompt lookup finds matches."""
    return [p + p[: 3 + i] for i, p in enumerate(prompts(n, lengths=(6, 13, 4, 9)))]


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_prompt_lookup_equals_greedy(family, k):
    stock, fast = _pair(family)
    ids, mask = pad(_echo_prompts())
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    expected = stock.generate(**kw)
    got = fast.generate(**kw, prompt_lookup_num_tokens=k, max_matching_ngram_size=2)
    assert torch.equal(got, expected)
    stats = llmplug.spec_stats(fast)
    assert stats.steps > 0 and stats.drafted > 0 and stats.accepted <= stats.drafted
    assert stats.steps < stats.emitted or k == 1  # some steps emitted several tokens


def test_prompt_lookup_accepts_on_repetitive_text():
    """A model that repeats its input token (tied embeddings, layers scaled down so the residual stream is the token's
    embedding): prompt lookup predicts it, most drafts are accepted, and steps emit several tokens each."""
    stock, fast = _pair("llama", tie_word_embeddings=True)
    for model in (stock, fast):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2 and "embed" not in name and "lm_head" not in name:
                    p.mul_(0.01)
    llmplug.unoptimize(fast)
    llmplug.optimize(fast)
    ids, mask = pad(_echo_prompts(2))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=64, do_sample=False)
    assert torch.equal(fast.generate(**kw, prompt_lookup_num_tokens=4), stock.generate(**kw))
    stats = llmplug.spec_stats(fast)
    assert stats.acceptance_rate > 0.5 and stats.tokens_per_step > 1.5


@pytest.mark.parametrize("same_weights", [True, False])
def test_draft_model_equals_greedy(same_weights):
    stock, fast = _pair("llama")
    draft = copy.deepcopy(stock) if same_weights else make_model("llama", num_hidden_layers=1)
    ids, mask = pad(prompts(3, lengths=(5, 17, 9)))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    expected = stock.generate(**kw)
    got = fast.generate(**kw, assistant_model=draft, num_assistant_tokens=4)
    assert torch.equal(got, expected)
    stats = llmplug.spec_stats(fast)
    assert stats.drafted > 0
    if same_weights:  # the target's own greedy tokens: every draft is accepted
        assert stats.accepted == stats.drafted and stats.tokens_per_step > 2
    assert state_of(draft) is not None and state_of(draft).runner.cache.blocks.num_used == 0  # pages returned


def test_draft_model_proposer_keeps_the_kv_of_accepted_drafts():
    """The drafts stay on the device; the proposer learns them on its next call, so a row whose drafts were all
    accepted feeds the draft model only its last draft and the bonus token."""
    draft = llmplug.optimize(make_model("llama"))
    ids = torch.tensor(prompts(2, lengths=(7, 7)))
    batch = SequenceBatch(state_of(draft).runner, ids, None, max_length=30, prefix_cache=False)
    proposer = DraftModelProposer(batch)
    histories = [row + [5] for row in ids.tolist()]
    drafts = proposer.propose([0, 1], histories, 3)
    assert isinstance(drafts, torch.Tensor) and drafts.shape == (2, 3)
    for history, row in zip(histories, drafts.tolist()):
        history.extend(row + [9])  # every draft accepted, then the target's own token
    fed = []
    step = batch.runner.step
    batch.runner.step = lambda ctx: fed.append(ctx.input_ids.shape[0]) or step(ctx)
    again = proposer.propose([0, 1], histories, 3)
    assert fed[0] == 2 * 2  # the catch-up step: each row's last draft and the bonus token
    assert torch.equal(again[:, 0], draft(input_ids=torch.tensor(histories)).logits[:, -1].argmax(-1))
    proposer.release()
    assert batch.runner.cache.blocks.num_used == 0


def test_eos_and_stopping_criteria_as_stock():
    """Rows end at different steps on an eos id (then emit pad) and on a user criterion, exactly as stock's loop."""
    stock, fast = _pair("llama")
    ids, mask = pad(_echo_prompts())
    plain = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    eos = int(plain[1, ids.shape[1] + 6])  # row 1's seventh new token

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == int(plain[2, ids.shape[1] + 3])

    for extra in (dict(eos_token_id=eos, pad_token_id=0), dict(stopping_criteria=StoppingCriteriaList([StopAfter()])),
                  dict(eos_token_id=eos, pad_token_id=0, stopping_criteria=StoppingCriteriaList([StopAfter()]))):
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, **extra)
        assert torch.equal(fast.generate(**kw, prompt_lookup_num_tokens=3), stock.generate(**kw)), extra


@pytest.mark.parametrize("new_tokens", [1, 2, 3])
def test_short_generations(new_tokens):
    stock, fast = _pair("llama")
    ids, mask = pad(_echo_prompts())
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(fast.generate(**kw, prompt_lookup_num_tokens=5), stock.generate(**kw))


def test_calls_speculation_cannot_take_decode_without_it():
    """Sampling, processors and a streamer keep llmplug's usual loop (same tokens or distribution), with a warning."""
    stock, fast = _pair("llama")
    ids, mask = pad(_echo_prompts())
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, repetition_penalty=1.3)
    with pytest.warns(UserWarning, match="speculates only"):
        got = fast.generate(**kw, prompt_lookup_num_tokens=3)
    assert torch.equal(got, stock.generate(**kw))


def test_bad_draft_model():
    _, fast = _pair("llama")
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(TypeError, match="assistant_model must be"):
        fast.generate(input_ids=ids, assistant_model="small-model", max_new_tokens=3)
    big = make_model("llama", vocab_size=256)
    with pytest.raises(ValueError, match="share the model's tokenizer"):
        fast.generate(input_ids=ids, assistant_model=big, max_new_tokens=3)


def test_adaptive_k():
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens(1.0, 4) == 5.0
    policy = AdaptiveK(4, ridge=256.0)
    assert policy.choose(1) == 4  # weight-bound: a longer step costs only its overhead
    for _ in range(40):
        policy.record(drafted=4, accepted=0)
    assert policy.alpha < 0.01 and policy.choose(1) == 0  # nothing accepted: off (a block of plain steps) ...
    # ... then a probe; each probe that fails doubles the blocks before the next, up to max_backoff (8)
    assert [policy.choose(1) for _ in range(32)] == ([4] + [0] * 2 + [4] + [0] * 4 + [4] + [0] * 8 + [4] + [0] * 8
                                                     + [4] + [0] * 5)
    policy.record(drafted=4, accepted=4)
    for _ in range(4):
        policy.record(drafted=4, accepted=4)
    assert policy.choose(1) == 4 and policy.choose(1) == 4  # acceptance came back: speculating again ...
    for _ in range(40):
        policy.record(drafted=4, accepted=0)
    assert [policy.choose(1) for _ in range(3)] == [0, 4, 0]  # ... and when it goes, one block before the next probe
    policy = AdaptiveK(4, ridge=256.0)
    for _ in range(40):
        policy.record(drafted=4, accepted=3)
    assert policy.choose(1) == 4 and 0 < policy.choose(128) < 4  # nearly compute-bound: fewer drafts pay
    assert policy.choose(512) == 0  # compute-bound already: every draft costs its full share
    stepwise = AdaptiveK(4, ridge=256.0, probe_every=3)  # asked before every step (the Engine): a 0 holds a block
    for _ in range(40):
        stepwise.record(drafted=4, accepted=0)
    assert [stepwise.choose_step(1) for _ in range(8)] == [0, 0, 0, 4, 0, 0, 0, 0]  # block, probe, two blocks


def test_adaptive_k_uses_measured_step_costs():
    """Measured costs replace the weight-bound estimate: a batch-64 step of 1 + 4 tokens measured at 2.1x a plain
    step (the first sample of each shape is ignored: it may have captured a graph); shorter steps are interpolated."""
    policy = AdaptiveK(4, ridge=256.0)
    for _ in range(40):
        policy.record(drafted=4, accepted=2)  # alpha 0.5
    assert policy.choose(64) == 3  # the estimate: 256 tokens are still weight-bound
    for rows, q, seconds in [(64, 1, 9.0), (64, 1, 1.0), (64, 5, 9.0), (64, 5, 2.1)]:
        policy.record_cost(rows, q, seconds)
    assert policy.cost(64, 5) == pytest.approx(2.1) and policy.cost(64, 2) == pytest.approx(1.275)
    assert policy.choose(64) == 1  # 1.5 tokens for 1.275x beats 1.94 for 2.1x
    policy.record_cost(64, 2, 1.0)  # (the first sample of q = 2)
    policy.record_cost(64, 2, 1.6)
    assert policy.cost(64, 2) == pytest.approx(1.6) and policy.choose(64) == 0  # 1.5 tokens for 1.6x: off


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_speculation_on_cuda_graphs(family, monkeypatch):
    """On CUDA (fp32, graphs on): verify steps replay (rows bucket, 1 + k) graphs and, while acceptance is too low to
    pay, blocks of plain steps replay the greedy graph; tokens equal stock's throughout."""
    monkeypatch.setitem(generate_spec.RIDGE_TOKENS, "cuda", 256.0)
    stock, fast = _pair(family)
    stock.cuda()
    llmplug.unoptimize(fast)
    llmplug.optimize(fast.cuda(), graph_batch_sizes=(1, 4, 8))
    ids, mask = pad(_echo_prompts())
    kw = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=48, do_sample=False)
    expected = stock.generate(**kw)
    assert torch.equal(fast.generate(**kw, prompt_lookup_num_tokens=4), expected)
    graphs = state_of(fast).runner._graphs
    assert any(key[0] == "verify" and key[2] > 1 for key in graphs)  # verify steps (greedy: the verify graph)
    assert any(key[0] == "greedy" for key in graphs)  # a random tiny model's acceptance turns speculation off
    draft = copy.deepcopy(stock)
    assert torch.equal(fast.generate(**kw, assistant_model=draft, num_assistant_tokens=3), expected)
    assert llmplug.spec_stats(fast).acceptance_rate == 1.0


def _biased_rejection(probs, drafts, counts, generators=None):
    """A plausible bug: after a rejection, draw from ``p`` instead of the residual ``max(p - q, 0)``."""
    tokens, emitted = rejection_sample(probs, drafts, counts, generators=generators)
    rejected = (emitted - 1) < counts
    redraw = torch.multinomial(probs[torch.arange(len(emitted)), emitted - 1], 1).squeeze(1)
    tokens[rejected, emitted[rejected] - 1] = redraw[rejected]
    return tokens, emitted


@pytest.mark.parametrize("biased", [False, True])
def test_speculative_sampling_is_exact_in_distribution(biased, monkeypatch):
    """4,000 rows of one prompt, three new tokens: the first sampled as usual, the second by a verify step whose
    drafts (a copy of the model: its greedy tokens) are accepted or rejected. The (first, second) pairs follow the
    model's exact distribution after temperature and top-p (chi-square); a sampler that ignores the residual fails."""
    if biased:
        monkeypatch.setattr(spec_decode, "rejection_sample", _biased_rejection)
    stock, fast = _pair("llama")
    prompt = torch.tensor(prompts(1, lengths=(6,)))
    n = 4000
    warp = dict(do_sample=True, temperature=0.8, top_p=0.9, top_k=0)
    torch.manual_seed(0)
    out = fast.generate(input_ids=prompt.repeat(n, 1), max_new_tokens=3, eos_token_id=None, pad_token_id=0,
                        assistant_model=copy.deepcopy(stock), num_assistant_tokens=3, **warp)
    stats = llmplug.spec_stats(fast)
    assert 0 < stats.accepted < stats.drafted
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9)])

    def dist(ids):
        with torch.no_grad():
            logits = stock(input_ids=ids).logits[:, -1].float()
        return torch.softmax(processors(ids, logits), dim=-1)

    first = dist(prompt)[0]
    support = first.nonzero().squeeze(1)
    second = dist(torch.cat([prompt.repeat(len(support), 1), support[:, None]], dim=1))
    expected = (first[support, None] * second).reshape(-1) * n  # cell (t1, t2)
    observed = pair_counts(out[:, -3:-1].tolist(), support, second.shape[1])
    p_value, cells = chi_square_p(observed, expected)
    assert (p_value < 1e-6) if biased else (p_value > 1e-3), (cells, p_value)


def test_drafts_stay_inside_max_model_len():
    """Verify steps may compute up to k positions past a row's last token: k shrinks to fit max_model_len, and a call
    with no room left decodes without speculation (with the warning)."""
    stock, fast = _pair("llama")
    llmplug.unoptimize(fast)
    llmplug.optimize(fast, max_model_len=40)
    ids, mask = pad(_echo_prompts())  # 17 columns
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(fast.generate(**kw, max_new_tokens=21, prompt_lookup_num_tokens=6),
                       stock.generate(**kw, max_new_tokens=21))  # max_length 38: at most 2 drafts a step
    assert llmplug.spec_stats(fast).drafted > 0
    with pytest.warns(UserWarning, match="speculates only"):  # max_length 40: no room for a draft
        got = fast.generate(**kw, max_new_tokens=23, prompt_lookup_num_tokens=6)
    assert torch.equal(got, stock.generate(**kw, max_new_tokens=23))
