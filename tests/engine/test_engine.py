"""``llmplug.Engine`` end to end on CPU (fp32 tiny models, reference ops): equal to stock HF ``generate`` per request
under continuous batching and chunked prefill; eos and stop ids, penalties, seeded ``n > 1`` sampling, aborts,
streaming, threads, asyncio, text prompts, stop strings, stats and bad input. Scheduling, preemption, prefix caching
and the soak are in test_scheduler.py."""

import asyncio
import copy
import threading
import time

import pytest
import torch
from transformers import GenerationConfig

import llmplug
from llmplug import Engine, EngineConfig, SamplingParams
from tests.tiny_models import make_model, prompts, reference_kernels
from tests.tiny_tokenizer import make_tokenizer

STATS_KEYS = {"finished_requests", "steps", "ttft_s", "tpot_s", "itl_s", "e2e_s", "output_tokens", "output_tok_s",
              "total_tok_s", "goodput_req_s", "slo_attainment", "slo", "kv_utilisation_mean", "kv_utilisation_max",
              "kv_waste_max", "prefix_hit_rate", "prefix_hit_tokens", "preemptions", "ring_blocks", "ring_steps"}


@pytest.fixture(autouse=True)
def _references():
    with reference_kernels():
        yield


# ---- helpers (also used by test_scheduler.py) ------------------------------------------------------------------------
def make_engine(family: str = "llama", num_blocks: int = 64, block_size: int = 8, tokenizer=None, stock=None,
                eos=2, **config) -> tuple[torch.nn.Module, Engine]:
    """``(stock model, Engine)`` over an optimized copy of it (eos ids ``eos``) with a pool of ``num_blocks`` pages.

    The stock model never stops at eos by itself (the tests say which stop ids apply).
    """
    if stock is None:
        stock = make_model(family)
        stock.generation_config.eos_token_id = None
    fast = copy.deepcopy(stock)
    fast.generation_config.eos_token_id = eos
    llmplug.optimize(fast, kv_num_blocks=num_blocks, kv_block_size=block_size)
    return stock, Engine(fast, EngineConfig(**config), tokenizer=tokenizer)


def hf_greedy(stock: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos=None) -> list[int]:
    """Stock HF greedy continuation of one prompt (batch 1), stopping at ``eos`` (kept, as the engine does)."""
    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=eos)
    return stock.generate(torch.tensor([prompt]), generation_config=gc)[0, len(prompt):].tolist()


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **kw)


def assert_all_blocks_back(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.has_work()
    assert engine.blocks.num_used == 0 and engine.blocks.ref == {}
    assert engine.blocks.num_free == engine.blocks.num_total
    swap = engine.scheduler.swap
    if swap is not None:
        assert swap.allocator.num_free == swap.allocator.num_blocks


def run_to_end(engine: Engine, max_steps: int = 10_000) -> dict:
    """Step until idle; ``{request_id: RequestOutput}`` of everything that finished."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        done.update((o.request_id, o) for o in engine.step())
    raise AssertionError(f"engine still busy after {max_steps} steps")


def record_plans(engine: Engine) -> list:
    """Every :class:`StepPlan` the scheduler makes from now on, as ``[(seq, num_new, was_computed)]``, and copies."""
    plans = []
    schedule = engine.scheduler.schedule

    def wrapped():
        plan = schedule()
        plans.append(([(s, n, s.num_computed) for s, n in zip(plan.seqs, plan.num_new)], list(plan.copies),
                      list(plan.swap_in), len(plan.preempted)))
        return plan

    engine.scheduler.schedule = wrapped
    return plans


# ---- token-identical to stock HF generate ----------------------------------------------------------------------------
LENGTHS = (3, 30, 9, 41, 17, 1, 24)
NEW = (7, 5, 12, 6, 9, 8, 4)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gpt2"])
def test_continuous_batching_matches_stock_generate(family):
    stock, engine = make_engine(family, num_blocks=64, max_num_batched_tokens=16)
    rows = prompts(len(LENGTHS), lengths=LENGTHS)
    want = [hf_greedy(stock, p, n) for p, n in zip(rows, NEW)]
    plans = record_plans(engine)
    ids = [engine.add_request(rows[i], greedy(NEW[i])) for i in range(2)]
    done = {}
    for i in range(2, len(rows)):  # the rest arrive one per step while the first ones run
        done.update((o.request_id, o) for o in engine.step())
        ids.append(engine.add_request(rows[i], greedy(NEW[i])))
    done.update(run_to_end(engine))
    for i, rid in enumerate(ids):
        out = done[rid].outputs[0]
        assert out.token_ids == want[i], f"prompt {i} (length {LENGTHS[i]})"
        assert out.finish_reason == "length"
    assert all(sum(n for _, n, _ in seqs) <= 16 for seqs, *_ in plans)
    assert any(n < p.num_tokens - was for seqs, *_ in plans for p, n, was in seqs), "no prompt was chunked"
    assert any(len(seqs) > 2 for seqs, *_ in plans), "never batched"
    assert_all_blocks_back(engine)

    # stop ids that do trigger: one token from the middle of each greedy output
    stops = sorted({w[len(w) // 2] for w in want if len(w) > 2})
    want = [hf_greedy(stock, p, n, eos=stops) for p, n in zip(rows, NEW)]
    outs = engine.generate(rows, [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True,
                                                 stop_token_ids=tuple(stops)) for n in NEW], progress=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert_all_blocks_back(engine)


def test_steady_decode_steps_take_their_inputs_on_the_device(monkeypatch):
    """Decode steps of the rows the previous decode step sampled take its tokens and positions (+1) on the device
    and resend only changed page-table entries; outputs stay stock HF's, across pages filling up (block size 8)."""
    from llmplug.engine import engine as engine_mod

    stock, engine = make_engine("llama", num_blocks=64)
    rows = prompts(4, lengths=(5, 11, 3, 7))
    want = [hf_greedy(stock, p, 20) for p in rows]
    kinds, build = [], engine_mod.build_step

    def recorded(*args, **kwargs):
        kinds.append(kwargs.get("positions") is not None)
        return build(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "build_step", recorded)
    outs = engine.generate(rows, greedy(20), progress=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(kinds) >= 15, kinds  # all but the prompts' step and the first decode step
    assert_all_blocks_back(engine)


def test_model_eos_ids_stop_unless_ignored():
    stock = make_model("llama")
    stock.generation_config.eos_token_id = None
    rows = prompts(4, lengths=(6, 19, 2, 33))
    free = [hf_greedy(stock, p, 10) for p in rows]
    eos = [free[0][3], free[1][5]]
    _, engine = make_engine(stock=stock, eos=eos, max_num_batched_tokens=16)
    assert engine.eos_ids == frozenset(eos)
    outs = engine.generate(rows, SamplingParams(max_new_tokens=10, temperature=0.0), progress=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(stock, p, 10, eos=eos) for p in rows]
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].token_ids[-1] == eos[0]
    outs = engine.generate(rows, greedy(10), progress=False)
    assert [o.outputs[0].token_ids for o in outs] == free
    assert_all_blocks_back(engine)


def hf_generate(stock: torch.nn.Module, prompt: list[int], max_new_tokens: int, **kw) -> list[int]:
    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kw)
    return stock.generate(torch.tensor([prompt]), generation_config=gc)[0, len(prompt):].tolist()


def test_penalties_and_min_new_tokens_match_stock_generate():
    stock, engine = make_engine(max_num_batched_tokens=16)
    rows = prompts(4, lengths=(6, 19, 2, 27))
    firsts = sorted({hf_greedy(stock, p, 1)[0] for p in rows})  # stop ids that would end every request at once
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.5,
                            min_new_tokens=4, stop_token_ids=tuple(firsts))
    for row in rows:  # one at a time: see the next test for a batch
        (out,) = engine.generate(row, params, progress=False)
        want = hf_generate(stock, row, 10, eos_token_id=firsts, repetition_penalty=1.5, min_new_tokens=4)
        assert out.outputs[0].token_ids == want and len(want) >= 4
    assert_all_blocks_back(engine)


def test_a_request_stopping_beside_a_penalized_one_leaves_the_others_kv_alone():
    stock, engine = make_engine()
    a, b = prompts(2, lengths=(6, 9))
    pen = dict(repetition_penalty=1.2)
    stop = hf_generate(stock, a, 10, **pen)[2]
    rb = engine.add_request(b, greedy(10, **pen))  # gets page 0
    ra = engine.add_request(a, greedy(10, stop_token_ids=(stop,), **pen))  # stops at its third token
    done = run_to_end(engine)
    assert done[ra].outputs[0].token_ids == hf_generate(stock, a, 10, eos_token_id=[stop], **pen)
    assert done[rb].outputs[0].token_ids == hf_generate(stock, b, 10, **pen)


# ---- n > 1 sampling --------------------------------------------------------------------------------------------------
def test_n_sampled_with_seed_is_reproducible():
    stock, engine = make_engine(num_blocks=32)
    row = prompts(1, lengths=(13,))[0]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=40, n=3, seed=11, ignore_eos=True)
    (a,) = engine.generate(row, params, progress=False)
    others = prompts(3, lengths=(7, 30, 2), seed=9)  # same seed, different batch around it
    b = engine.generate([others[0], row, others[1], row, others[2]], [greedy(5), params, greedy(20), params, greedy(3)],
                        progress=False)
    samples = [c.token_ids for c in a.outputs]
    assert [c.token_ids for c in b[1].outputs] == samples == [c.token_ids for c in b[3].outputs]
    assert len({tuple(s) for s in samples}) == 3, "the three samples should differ (seeds seed, seed+1, seed+2)"
    _, fresh = make_engine(stock=stock, num_blocks=32)
    (c,) = fresh.generate(row, params, progress=False)
    assert [x.token_ids for x in c.outputs] == samples
    (d,) = fresh.generate(row, SamplingParams(max_new_tokens=8, n=3, seed=12, top_k=40, ignore_eos=True),
                          progress=False)
    assert [x.token_ids for x in d.outputs] != samples
    assert_all_blocks_back(engine)
    assert_all_blocks_back(fresh)


# ---- abort, streaming, threads, asyncio, text ------------------------------------------------------------------------
def test_abort_before_start_mid_prefill_and_mid_decode():
    stock, engine = make_engine(max_num_batched_tokens=16)
    rows = prompts(4, lengths=(5, 60, 7, 4))
    companion = engine.add_request(rows[3], greedy(120))  # keeps decoding beside the aborted ones (greedy blocks too)
    engine.step()
    before = engine.add_request(rows[0], greedy(8))
    engine.abort(before)
    (out,) = engine.step()
    assert (out.request_id, out.finished, out.outputs[0].finish_reason, out.outputs[0].token_ids) == \
        (before, True, "abort", [])

    prefill = engine.add_request(rows[1], greedy(8))
    engine.step()
    seq = engine._requests[prefill].seqs[0]
    assert 0 < seq.num_computed < len(rows[1]) and len(seq.blocks) > 0
    engine.abort(prefill)
    (out,) = engine.step()
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []

    decode = engine.add_request(rows[2], greedy(30))
    for _ in range(2):  # its prefill, then a block of greedy decode steps
        engine.step()
    engine.abort(decode)
    (out,) = engine.step()
    got = out.outputs[0].token_ids
    assert out.outputs[0].finish_reason == "abort" and out.finished and 0 < len(got) < 30
    assert got == hf_greedy(stock, rows[2], 30)[:len(got)]
    with pytest.raises(KeyError, match="nope"):
        engine.abort("nope")
    with pytest.raises(KeyError, match=decode):  # finished requests are unknown too
        engine.abort(decode)
    assert run_to_end(engine)[companion].outputs[0].token_ids == hf_greedy(stock, rows[3], 120)
    assert_all_blocks_back(engine)
    assert engine.generate(rows[0], greedy(3), progress=False)[0].outputs[0].token_ids == hf_greedy(stock, rows[0], 3)


def test_prompt_longer_than_the_step_budget_alone():
    stock, engine = make_engine(max_num_batched_tokens=16)
    row = prompts(1, lengths=(40,))[0]
    (out,) = engine.generate(row, greedy(4), progress=False)
    assert (out.error, out.outputs[0].finish_reason) == (None, "length")
    assert out.outputs[0].token_ids == hf_greedy(stock, row, 4)


def test_stream_deltas_add_up_to_the_output():
    stock, engine = make_engine(max_num_batched_tokens=16)
    rows = prompts(2, lengths=(35, 4))
    other = engine.add_request(rows[1], greedy(20))  # streams beside another request
    deltas = list(engine.stream(rows[0], greedy(9)))
    assert [t for d in deltas for t in d.token_ids] == hf_greedy(stock, rows[0], 9)
    assert all(d.token_ids for d in deltas) and all(not d.finished for d in deltas[:-1])
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    done = run_to_end(engine)
    assert done[other].outputs[0].token_ids == hf_greedy(stock, rows[1], 20)
    assert_all_blocks_back(engine)


def test_abandoned_stream_aborts_its_request():
    stock, engine = make_engine()
    row = prompts(1, lengths=(5,))[0]
    stream = engine.stream(row, greedy(200), request_id="left")
    first = next(stream)
    stream.close()  # what `break` out of `for delta in engine.stream(...)` does
    done = run_to_end(engine, max_steps=5)
    assert done["left"].outputs[0].finish_reason == "abort"
    assert done["left"].outputs[0].token_ids[:len(first.token_ids)] == first.token_ids
    assert_all_blocks_back(engine)


def test_background_loop_serves_threads_concurrently():
    stock, engine = make_engine(num_blocks=64, max_num_batched_tokens=32)
    rows = prompts(8, lengths=(4, 17, 9, 26, 1, 12, 30, 6))
    news = [3, 8, 5, 2, 7, 4, 6, 9]
    results = {}

    def worker(i):
        results[i] = engine.generate(rows[i], greedy(news[i]), progress=False)[0]

    engine.start()
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(rows))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert engine.is_running()
        with pytest.raises(RuntimeError, match="background loop"):
            engine.step()
    finally:
        engine.stop()
    assert not engine.is_running()
    for i, row in enumerate(rows):
        assert results[i].outputs[0].token_ids == hf_greedy(stock, row, news[i])
    assert_all_blocks_back(engine)


def test_agenerate_and_astream():
    stock, engine = make_engine(num_blocks=64)
    rows = prompts(4, lengths=(5, 14, 22, 3))

    async def main():
        async def stream(row):
            return [d async for d in engine.astream(row, greedy(6))]

        return await asyncio.gather(engine.agenerate(rows[0], greedy(6)), engine.agenerate(rows[1], greedy(6)),
                                    stream(rows[2]), engine.agenerate(rows[3], greedy(6), request_id="mine"))

    try:
        a, b, deltas, d = asyncio.run(main())
    finally:
        engine.stop()
    assert d.request_id == "mine"
    assert [a.outputs[0].token_ids, b.outputs[0].token_ids, [t for x in deltas for t in x.token_ids],
            d.outputs[0].token_ids] == [hf_greedy(stock, r, 6) for r in rows]
    assert deltas[-1].finished
    assert_all_blocks_back(engine)


def test_abandoned_astream_aborts_its_request_and_the_loop_survives():
    stock, engine = make_engine()
    row = prompts(1, lengths=(5,))[0]

    async def main():
        async for _ in engine.astream(row, greedy(250), request_id="gone"):
            request = engine._requests["gone"]
            break  # the client stops listening after the first delta
        deadline = time.perf_counter() + 10  # polled: a loaded CI machine may take a while to abort
        while "gone" in engine._requests and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        return request

    try:
        request = asyncio.run(main())
        deadline = time.perf_counter() + 10
        while engine.is_running() and engine.has_unfinished_requests() and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert engine.is_running() and engine._loop_error is None
        assert "gone" not in engine._requests
        assert request.seqs[0].num_output < 250, "the abandoned request kept generating to its end"
        (out,) = engine.generate(row, greedy(3), progress=False)
        assert out.outputs[0].token_ids == hf_greedy(stock, row, 3)
    finally:
        engine.stop()


def test_generate_after_the_loop_died_raises_instead_of_hanging():
    _, engine = make_engine()

    def broken():
        raise RuntimeError("scheduler broke")

    engine.scheduler.schedule = broken
    engine.start()
    engine.add_request([5, 6], greedy(2))
    deadline = time.perf_counter() + 10
    while engine.is_running() and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert not engine.is_running() and "scheduler broke" in repr(engine._loop_error)
    result = {}

    def call():
        try:
            engine.generate([5, 6], greedy(2), progress=False)
        except RuntimeError as error:
            result["error"] = error

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(2)
    engine.stop()
    assert "error" in result, "generate() hung on a dead engine loop"


def test_text_prompts_stop_strings_and_streamed_text():
    tok = make_tokenizer()
    stock, engine = make_engine(tokenizer=tok)
    prompt = "The quick brown fox jumps over"
    ids = tok(prompt)["input_ids"]
    (full,) = engine.generate(prompt, greedy(24), progress=False)
    assert full.prompt == prompt and full.prompt_token_ids == ids
    assert full.outputs[0].token_ids == hf_greedy(stock, ids, 24)
    text = full.outputs[0].text
    assert text == tok.decode(full.outputs[0].token_ids, skip_special_tokens=True) and len(text) >= 6
    stop = text[3:5]
    (cut,) = engine.generate(prompt, greedy(24, stop=(stop, "never there")), progress=False)
    assert cut.outputs[0].text == text[:text.find(stop)]
    assert cut.outputs[0].finish_reason == "stop"
    got = cut.outputs[0].token_ids
    assert got == full.outputs[0].token_ids[:len(got)] and len(got) < 24
    deltas = list(engine.stream(prompt, greedy(24)))
    assert "".join(d.text for d in deltas) == text
    assert [t for d in deltas for t in d.token_ids] == full.outputs[0].token_ids
    assert_all_blocks_back(engine)


def test_streamed_text_never_shows_part_of_a_stop_string():
    tok = make_tokenizer()
    stock, engine = make_engine(tokenizer=tok)
    prompt = "The quick brown fox jumps over"
    (full,) = engine.generate(prompt, greedy(24), progress=False)
    text = full.outputs[0].text
    assert len(text) >= 8
    for stop in (text[3:5], text[2:5], text[5:8]):
        deltas = list(engine.stream(prompt, greedy(24, stop=(stop,))))
        assert "".join(d.text for d in deltas) == text[:text.find(stop)], stop
        assert deltas[-1].finish_reason == "stop"
    assert_all_blocks_back(engine)


def test_stats_keys_and_values():
    _, engine = make_engine(num_blocks=64, max_num_batched_tokens=16)
    rows = prompts(5, lengths=(6, 20, 3, 11, 8))
    outs = engine.generate(rows, greedy(5), progress=False)
    s = engine.stats()
    assert set(s) >= STATS_KEYS
    assert s["finished_requests"] == 5 and s["steps"] > 5
    assert s["output_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs) == 25
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        p = s[key]
        assert 0 < p["p50"] <= p["p95"] <= p["p99"], key
    assert s["ttft_s"]["p99"] <= s["e2e_s"]["p99"]
    assert s["output_tok_s"] > 0 and s["total_tok_s"] > s["output_tok_s"]
    assert 0 < s["kv_utilisation_mean"] <= s["kv_utilisation_max"] <= 1 and 0 <= s["kv_waste_max"] < 1
    assert 0 <= s["slo_attainment"] <= 1 and s["preemptions"] == 0 and s["prefix_hit_rate"] == 0
    for o in outs:
        assert o.arrival_time <= o.first_token_time <= o.finish_time
        assert len(o.outputs[0].token_times) == 5


def test_stats_count_only_delivered_tokens_when_requests_stop_early():
    stock, engine = make_engine()
    rows = prompts(4, lengths=(5, 9, 3, 12))
    stops = tuple(sorted({hf_greedy(stock, r, 10)[2] for r in rows}))
    outs = engine.generate(rows, greedy(10, stop_token_ids=stops), progress=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert engine.stats()["output_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs)


# ---- bad input -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, params, error, match", [
    ([], None, ValueError, "empty prompt"),
    ([5] * 250, SamplingParams(max_new_tokens=10), ValueError, "max_model_len=256"),
    ([5] * 60, SamplingParams(max_new_tokens=10), ValueError, "whole KV pool"),
    ([5, 128, 7], None, ValueError, r"\[128\]"),
    ([5, -1], None, ValueError, r"\[-1\]"),
    ([5, 2 ** 70], None, ValueError, "outside the vocabulary"),
    ([5, 6.0], None, TypeError, "integers"),
    (torch.tensor([[5, 6]]), None, TypeError, "1-D integer"),
    (torch.tensor([5.0, 6.0]), None, TypeError, "1-D integer"),
    ("some text", None, ValueError, "tokenizer"),
    ([5, 6], SamplingParams(stop=("x",)), ValueError, "tokenizer"),
    ([5, 6], {"max_new_tokens": 3}, TypeError, "SamplingParams"),
])
def test_bad_requests_raise_and_the_engine_keeps_serving(prompt, params, error, match):
    stock, engine = make_engine(num_blocks=8)  # a pool of 64 tokens
    running = engine.add_request([9, 8, 7], greedy(4))
    engine.step()
    with pytest.raises(error, match=match):
        engine.add_request(prompt, params)
    done = run_to_end(engine)
    assert done[running].outputs[0].token_ids == hf_greedy(stock, [9, 8, 7], 4)
    assert engine.generate([3, 4, 5], greedy(4), progress=False)[0].outputs[0].token_ids == \
        hf_greedy(stock, [3, 4, 5], 4)
    assert_all_blocks_back(engine)


def test_prompt_ids_as_tuple_tensor_or_list_give_the_same_tokens():
    stock, engine = make_engine()
    row = [9, 8, 7, 6]
    outs = engine.generate([row, tuple(row), torch.tensor(row), torch.tensor(row, dtype=torch.int32)], greedy(5),
                           progress=False)
    assert all(o.prompt_token_ids == row and type(o.prompt_token_ids[0]) is int for o in outs)
    assert all(o.outputs[0].token_ids == hf_greedy(stock, row, 5) for o in outs)
    (one,) = engine.generate(torch.tensor(row), greedy(5), progress=False)  # a 1-D tensor is one prompt
    assert one.outputs[0].token_ids == hf_greedy(stock, row, 5)
    with pytest.raises(ValueError, match="1-D prompt"):
        engine.generate(torch.tensor([row, row]), greedy(5), progress=False)


@pytest.mark.parametrize("kw, match", [
    (dict(max_new_tokens=0), "max_new_tokens=0"), (dict(max_new_tokens=True), "max_new_tokens=True"),
    (dict(min_new_tokens=5, max_new_tokens=4), "min_new_tokens=5"), (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(top_k=-1), "top_k=-1"), (dict(top_k=2.5), "top_k=2.5"), (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"), (dict(min_p=1.0), "min_p=1.0"),
    (dict(repetition_penalty=0), "repetition_penalty=0"),
    (dict(frequency_penalty=3.0), "frequency_penalty=3.0"), (dict(presence_penalty=-2.5), "presence_penalty=-2.5"),
    (dict(seed=1.5), "seed=1.5"), (dict(stop_token_ids=(-3,)), r"stop_token_ids=\(-3,\)"), (dict(stop=("",)), "stop="),
    (dict(n=0), "n=0"), (dict(priority="high"), "priority='high'"),
])
def test_invalid_sampling_params_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(policy="lifo"), "policy='lifo'"), (dict(preemption_mode="drop"), "preemption_mode='drop'"),
    (dict(max_num_batched_tokens=8), "max_num_batched_tokens=8"), (dict(max_num_seqs=0), "max_num_seqs=0"),
    (dict(watermark=0.7), "watermark=0.7"), (dict(swap_space_gb=-1), "swap_space_gb=-1"),
])
def test_invalid_engine_config_names_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_duplicate_request_id_and_param_list_mismatch():
    stock, engine = make_engine()
    engine.add_request([5, 6, 7], greedy(3), request_id="a")
    with pytest.raises(ValueError, match="'a'"):
        engine.add_request([8, 9], greedy(3), request_id="a")
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        engine.generate([[1, 2]], [greedy(2), greedy(2)], progress=False)
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(engine.model, config={"max_num_seqs": 2})
    done = run_to_end(engine)
    assert done["a"].outputs[0].token_ids == hf_greedy(stock, [5, 6, 7], 3)
    engine.add_request([8, 9], greedy(3), request_id="a")  # free again once finished
    assert run_to_end(engine)["a"].outputs[0].token_ids == hf_greedy(stock, [8, 9], 3)
    assert_all_blocks_back(engine)


def test_a_stop_id_outside_the_vocabulary_fails_only_its_own_request():
    stock, engine = make_engine()
    good = engine.add_request([5, 6, 7], greedy(4))
    try:
        engine.add_request([8, 9], SamplingParams(max_new_tokens=4, min_new_tokens=2, stop_token_ids=(500,)))
    except ValueError as error:
        assert "500" in str(error)
    done = run_to_end(engine)
    assert done[good].error is None and done[good].outputs[0].token_ids == hf_greedy(stock, [5, 6, 7], 4)


def test_generated_ids_never_collide_with_given_ones():
    _, engine = make_engine()
    ids = [engine.add_request([5, 6], greedy(2), request_id="req_1")]
    ids += [engine.add_request([5, 6], greedy(2)) for _ in range(2)]
    assert len(set(ids)) == 3
    run_to_end(engine)


def test_generate_on_the_background_loop_waits_for_every_prompt():
    tok = make_tokenizer()

    class SlowTokenizer:  # the second prompt takes a while to tokenize; the first request finishes meanwhile
        def __init__(self):
            self.calls = 0

        def __call__(self, text, **kw):
            self.calls += 1
            if self.calls == 2:
                time.sleep(0.5)
            return tok(text, **kw)

        def decode(self, *args, **kw):
            return tok.decode(*args, **kw)

    stock, engine = make_engine(tokenizer=SlowTokenizer())
    engine.start()
    try:
        outs = engine.generate(["ab", "cd"], greedy(1), progress=False)
    finally:
        engine.stop()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(stock, tok(t)["input_ids"], 1) for t in ("ab", "cd")]


def test_model_generate_still_works_after_the_engine_ran():
    stock, engine = make_engine(num_blocks=8)
    a, b = prompts(2, lengths=(40, 40))
    engine.generate(a, greedy(8), progress=False)
    assert_all_blocks_back(engine)
    out = engine.model.generate(torch.tensor([b]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert out[0, 40:].tolist() == hf_greedy(stock, b, 8)
