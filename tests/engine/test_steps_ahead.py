"""``EngineConfig.steps_ahead``: several plain steps in flight before the host reads one. Outputs equal stock HF
``generate`` (and the one-step-ahead engine) through chunked prefill, preemption by recompute and by swap, stop ids,
penalties, seeded sampling, streaming and aborts; a preempted sequence comes back with placeholders of steps still in
flight and gets their tokens on the device."""

import pytest

from llmplug import EngineConfig, SamplingParams, StreamDelta
from tests.engine.test_engine import assert_all_blocks_back, greedy, hf_greedy, make_engine, run_to_end
from tests.engine.test_scheduler import SWAP_BLOCK_BYTES
from tests.tiny_models import prompts, reference_kernels


@pytest.fixture(autouse=True)
def _references():
    with reference_kernels():
        yield


def watch(engine) -> dict:
    """Count, per step, the steps in flight after it and the planned chunks that cover placeholder tokens."""
    seen = {"most_in_flight": 0, "chunks_over_placeholders": 0}
    step, schedule = engine._step, engine.scheduler.schedule

    def stepped():
        out = step()
        seen["most_in_flight"] = max(seen["most_in_flight"], len(engine._inflight))
        return out

    def scheduled():
        plan = schedule()
        seen["chunks_over_placeholders"] += sum(n > 1 and s.resolved < s.num_computed + n
                                                for s, n in zip(plan.seqs, plan.num_new))
        return plan

    engine._step, engine.scheduler.schedule = stepped, scheduled
    return seen


@pytest.mark.parametrize("ahead", [2, 3])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_equal_stock_generate_through_preemption(ahead, mode):
    lengths, news = (26, 30, 15, 3, 10, 18, 17), (15, 28, 29, 12, 18, 14, 21)
    stock, engine = make_engine(num_blocks=12, preemption_mode=mode, swap_space_gb=6 * SWAP_BLOCK_BYTES / 1e9,
                                max_num_batched_tokens=16, steps_ahead=ahead)
    seen = watch(engine)
    rows = prompts(len(lengths), lengths=lengths)
    outs = engine.generate(rows, [greedy(n) for n in news], progress=False)
    assert engine.scheduler.num_preemptions > 0
    assert seen["most_in_flight"] == ahead
    if mode == "recompute":  # a preempted row's prefill again, over tokens of steps still in flight
        assert seen["chunks_over_placeholders"] > 0
    for row, n, out in zip(rows, news, outs):
        assert out.outputs[0].token_ids == hf_greedy(stock, row, n)
    assert_all_blocks_back(engine)


def test_stop_ids_penalties_seeds_and_streams_equal_one_step_ahead():
    rows = prompts(5, lengths=(6, 19, 4, 33, 11))
    params = [SamplingParams(max_new_tokens=24, temperature=0.0),  # stops at eos (2) if it comes
              SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=[7, 11, 13]),
              SamplingParams(max_new_tokens=16, temperature=0.9, top_k=20, seed=3, n=2),
              SamplingParams(max_new_tokens=12, temperature=0.0, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=18, temperature=0.7, top_p=0.8, seed=5)]
    results, stock = {}, None
    for ahead in (1, 2, 3):
        stock, engine = make_engine(num_blocks=64, max_num_batched_tokens=16, steps_ahead=ahead, stock=stock)
        deltas = {}
        for i, (row, p) in enumerate(zip(rows, params)):
            engine.add_request(row, p, request_id=f"r{i}",
                               on_event=lambda d, i=i, deltas=deltas: isinstance(d, StreamDelta)
                               and deltas.setdefault(i, []).extend(d.token_ids))
        done = run_to_end(engine)
        outs = {rid: [(c.token_ids, c.finish_reason) for c in o.outputs] for rid, o in done.items()}
        results[ahead] = (outs, deltas)
        assert_all_blocks_back(engine)
    assert any(reason == "stop" for outs, _ in results.values() for o in outs.values() for _, reason in o)
    assert len(results[1][1]) == len(rows)  # every request streamed
    assert results[2] == results[1] and results[3] == results[1]


def test_abort_with_steps_in_flight_keeps_only_the_tokens_read():
    stock, engine = make_engine(num_blocks=64, steps_ahead=2)
    rows = prompts(2, lengths=(7, 9))
    other = engine.add_request(rows[1], greedy(40))
    rid = engine.add_request(rows[0], greedy(40))
    for _ in range(6):
        engine.step()
    assert len(engine._inflight) == 2
    engine.abort(rid)
    (out,) = [o for o in engine.step() if o.request_id == rid]
    got = out.outputs[0].token_ids
    assert out.outputs[0].finish_reason == "abort" and 0 < len(got) < 40
    assert got == hf_greedy(stock, rows[0], 40)[:len(got)]
    assert run_to_end(engine)[other].outputs[0].token_ids == hf_greedy(stock, rows[1], 40)
    assert_all_blocks_back(engine)


@pytest.mark.parametrize("value", [0, 5, 1.5, "2"])
def test_bad_steps_ahead_names_the_value(value):
    with pytest.raises(ValueError, match=f"steps_ahead={value!r}"):
        EngineConfig(steps_ahead=value)
