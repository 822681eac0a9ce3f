"""HF generate features behave as stock HF does (fp32 CPU, reference kernels)."""

import warnings

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList, pipeline
from transformers.generation.streamers import BaseStreamer

import llmplug
from llmplug.engine import generate as generate_module
from llmplug.ops._triton import cpu_kernels
from llmplug.state import state_of
from tests.tiny_models import make_model, pad, prompts
from tests.tiny_tokenizer import make_tokenizer


@pytest.fixture(autouse=True)
def _references():
    with cpu_kernels(False):
        yield


def _pair(family="llama"):
    """A stock model and an optimized copy with the same weights."""
    stock = make_model(family)
    fast = make_model(family)
    fast.load_state_dict(stock.state_dict())
    return stock, llmplug.optimize(fast)


def _both(stock, fast, seed=None, **kw):
    outs = []
    for m in (stock, fast):
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(m.generate(**kw))
    return outs


def test_sampling_with_seed_matches_stock_and_is_reproducible():
    stock, fast = _pair()
    ids, mask = pad(prompts(3))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20,
              top_p=0.9, min_p=0.02, repetition_penalty=1.3)
    a, b = _both(stock, fast, seed=7, **kw)
    assert torch.equal(a, b)
    _, c = _both(stock, fast, seed=7, **kw)
    assert torch.equal(b, c)
    _, d = _both(stock, fast, seed=8, **kw)
    assert not torch.equal(c, d)


@pytest.mark.parametrize("kw", [
    dict(eos_token_id=[5, 9, 17], max_new_tokens=15),
    dict(min_new_tokens=6, max_new_tokens=9, eos_token_id=[5, 9, 17]),
    dict(max_length=20),
    dict(prefix_allowed_tokens_fn=lambda batch, ids: [int(ids[-1]) % 50 + 3, 7, 11], max_new_tokens=6),
    dict(num_return_sequences=2, do_sample=True, max_new_tokens=6),
    dict(generation_config=GenerationConfig(max_new_tokens=7, do_sample=False, repetition_penalty=2.0,
                                            pad_token_id=0, eos_token_id=2)),
])
def test_generation_options_match_stock(kw, monkeypatch):
    monkeypatch.setattr(generate_module, "_warned", set())  # a fallback would warn, even if it warned before
    stock, fast = _pair()
    ids, mask = pad(prompts(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, b = _both(stock, fast, seed=3, input_ids=ids, attention_mask=mask, **kw)
    assert not [w for w in caught if "llmplug" in str(w.message)], "fell back to stock generate"
    assert torch.equal(a, b)


def test_right_padding_falls_back_to_stock_with_its_answer(monkeypatch):
    """Stock HF predicts a right-padded row's next token from its last (pad) position; llmplug gives that answer."""
    monkeypatch.setattr(generate_module, "_warned", set())
    stock, fast = _pair()
    ids, mask = pad(prompts(3), side="right")
    a = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    with pytest.warns(UserWarning, match="right-padded"):
        b = fast.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b)


def test_return_dict_scores_and_logits():
    stock, fast = _pair()
    ids, mask = pad(prompts(2))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True,
              output_scores=True, output_logits=True, repetition_penalty=1.5)
    a, b = _both(stock, fast, **kw)
    assert type(a) is type(b)
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.scores) == len(b.scores) == 4
    for x, y in zip(a.scores + a.logits, b.scores + b.logits):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_stop_strings_and_custom_stopping_criteria():
    stock, fast = _pair()
    tok = make_tokenizer()
    ids, mask = pad(prompts(2, vocab=len(tok)))

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 3, dtype=torch.bool)

    a, b = _both(stock, fast, input_ids=ids, attention_mask=mask, max_new_tokens=10,
                 stopping_criteria=StoppingCriteriaList([StopAfter()]))
    assert torch.equal(a, b) and b.shape[1] == ids.shape[1] + 3
    text = tok.decode(stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10)[0, ids.shape[1]:])
    stop = text[2:4]
    a, b = _both(stock, fast, input_ids=ids, attention_mask=mask, max_new_tokens=10, stop_strings=[stop],
                 tokenizer=tok)
    assert torch.equal(a, b)


def test_streamer_receives_prompt_then_each_token():
    _, fast = _pair()
    ids = torch.tensor([prompts(1)[0]])

    class Collect(BaseStreamer):
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    s = Collect()
    out = fast.generate(input_ids=ids, max_new_tokens=5, streamer=s, do_sample=False)
    assert s.ended and s.puts[0] == ids.tolist()
    assert [p[0] for p in s.puts[1:]] == out[0, ids.shape[1]:].tolist()


def test_beam_search_falls_back_to_stock_with_a_warning():
    stock, fast = _pair()
    ids, mask = pad(prompts(2))
    with pytest.warns(UserWarning, match="num_beams=3"):
        b = fast.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3)
    a = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3)
    assert torch.equal(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one-time warning
        fast.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, num_beams=3)


def test_pipeline_text_and_chat():
    stock, fast = _pair()
    tok = make_tokenizer()
    for inputs in (["hello there", "a"], [[{"role": "user", "content": "hi"}]]):
        outs = [pipeline("text-generation", model=m, tokenizer=tok)(inputs, max_new_tokens=6, do_sample=False)
                for m in (stock, fast)]
        assert outs[0] == outs[1]


@pytest.mark.parametrize("case", ["all-zero mask row", "past max_position_embeddings", "past max_model_len"])
def test_where_stock_runs_llmplug_falls_back(case, monkeypatch):
    monkeypatch.setattr(generate_module, "_warned", set())
    stock, fast = _pair()
    kw = dict(input_ids=torch.tensor([[5, 6], [7, 8]]), max_new_tokens=3, do_sample=False)
    if case == "all-zero mask row":
        kw["attention_mask"] = torch.tensor([[0, 0], [1, 1]])
        match = "all zeros"
    else:
        kw["max_new_tokens"] = 260  # past 256 positions
        match = "max_model_len=256 .the model's max_position_embeddings"
    if case == "past max_model_len":
        llmplug.unoptimize(fast)
        llmplug.optimize(fast, max_model_len=64)
        kw["max_new_tokens"] = 70
        match = r"max_model_len=64 \(set by llmplug.optimize\(model, max_model_len=64\)"
    a = stock.generate(**kw)
    with pytest.warns(UserWarning, match=match):
        b = fast.generate(**kw)
    assert torch.equal(a, b)


def test_pages_cover_tokens_with_under_one_page_slack():
    _, fast = _pair()
    from llmplug.engine.sequences import SequenceBatch

    ids, mask = pad(prompts(3, lengths=(5, 17, 33)))
    batch = SequenceBatch(state_of(fast).runner, ids, mask, max_length=64)
    batch.prefill()
    p = batch.block_size
    for n, seq in zip((5, 17, 33), batch.seqs):
        assert seq.num_computed == n and n <= len(seq.blocks) * p < n + p
    pool = state_of(fast).runner.cache.blocks
    before = pool.num_free
    batch.release()
    assert pool.num_free == before + sum(-(-n // p) for n in (5, 17, 33))


def test_graph_loop_eligibility():
    """Which stopping criteria and warpers the on-device (CUDA graph) decoding loop takes over."""
    from transformers import (
        EosTokenCriteria,
        MaxLengthCriteria,
        MaxTimeCriteria,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    eos, limit = generate_module._graph_stopping(
        [MaxLengthCriteria(30), EosTokenCriteria([5, 9]), MaxLengthCriteria(25)], max_length=40)
    assert eos.tolist() == [5, 9] and limit == 25
    assert generate_module._graph_stopping([MaxLengthCriteria(30)], 40)[0].numel() == 0
    assert generate_module._graph_stopping([MaxTimeCriteria(1.0)], 40)[1] == 40  # a host criterion: run late
    assert generate_module._graph_stopping([EosTokenCriteria(list(range(9)))], 40) is None  # > MAX_EOS ids
    warpers = [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)]
    assert all(type(p) in generate_module._GRAPH_WARPERS for p in warpers)
    assert RepetitionPenaltyLogitsProcessor not in generate_module._GRAPH_WARPERS  # reads the growing input_ids
    key = generate_module._processors_key(warpers)
    assert key == generate_module._processors_key([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)])
    assert key != generate_module._processors_key([TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9)])
