"""HF's continuous-batching API (generate_batch, init_continuous_batching) on llmplug's Engine (fp32 CPU)."""

import asyncio
import warnings

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

import llmplug
from llmplug.ops._triton import cpu_kernels
from llmplug.state import STATE_ATTR, state_of
from tests.tiny_models import make_model, prompts


@pytest.fixture(autouse=True)
def _references():
    with cpu_kernels(False):
        yield


@pytest.fixture(scope="module")
def pair():
    """A stock model and an optimized copy with the same weights (shared by the tests: the engine stays warm)."""
    torch.manual_seed(0)
    stock = make_model("llama")
    fast = make_model("llama")
    fast.load_state_dict(stock.state_dict())
    llmplug.optimize(fast)
    yield stock, fast
    llmplug.unoptimize(fast)


def _greedy(max_new_tokens=6, **kw):
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, **kw)


def _stock_alone(stock, prompt, **kw):
    """Stock HF generate of one prompt: its new tokens."""
    out = stock.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_generate_batch_greedy_matches_stock_generate(pair):
    stock, fast = pair
    rows = prompts(5)
    res = fast.generate_batch(rows, _greedy(7, eos_token_id=None))
    assert list(res) == [f"req_{i}" for i in range(5)]
    for i, row in enumerate(rows):
        out = res[f"req_{i}"]
        assert isinstance(out, GenerationOutput)
        assert out.request_id == f"req_{i}" and out.prompt_ids == row
        assert out.status == RequestStatus.FINISHED and out.error is None and out.logprobs == []
        assert out.timestamps is None
        assert out.generated_tokens == _stock_alone(stock, row, max_new_tokens=7, eos_token_id=None)


def test_generate_batch_stops_on_eos_like_stock(pair):
    stock, fast = pair
    rows = prompts(3)
    free = [_stock_alone(stock, row, max_new_tokens=8, eos_token_id=None) for row in rows]
    eos = free[0][2]  # the first prompt ends on its third token
    res = fast.generate_batch(rows, _greedy(8, eos_token_id=eos))
    for i, row in enumerate(rows):
        expected = _stock_alone(stock, row, max_new_tokens=8, eos_token_id=eos)
        assert res[f"req_{i}"].generated_tokens == expected
    assert res["req_0"].generated_tokens == free[0][:3]


def test_model_eos_and_max_length_are_read_from_the_config(pair):
    stock, fast = pair
    rows = prompts(2)
    config = GenerationConfig(max_length=12, do_sample=False, eos_token_id=[5, 9])
    res = fast.generate_batch(rows, config)
    for i, row in enumerate(rows):
        assert res[f"req_{i}"].generated_tokens == _stock_alone(stock, row, max_length=12, eos_token_id=[5, 9])


def test_num_return_sequences_keys_order_like_hf(pair):
    _, fast = pair
    rows = prompts(3)
    config = GenerationConfig(max_new_tokens=4, do_sample=True, top_k=20, num_return_sequences=2, eos_token_id=None)
    res = fast.generate_batch(rows, config)
    assert list(res) == ["req_0__child#0", "req_0", "req_1__child#0", "req_1", "req_2__child#0", "req_2"]
    for key, out in res.items():
        assert out.request_id == key and out.status == RequestStatus.FINISHED
        assert out.prompt_ids == rows[int(key.split("__")[0][4:])]
        assert len(out.generated_tokens) == 4


def test_record_timestamps(pair):
    _, fast = pair
    res = fast.generate_batch(prompts(2), _greedy(5, eos_token_id=None), record_timestamps=True, progress_bar=True)
    for out in res.values():
        ts = out.timestamps
        assert len(ts) == 5 and ts == sorted(ts)
        assert out.created_time <= out.lifespan[0] <= ts[0] and ts[-1] <= out.lifespan[1]


def test_paged_generate_returns_what_hf_returns(pair):
    stock, fast = pair
    ids = torch.tensor(prompts(3, lengths=(6,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fast.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, cache_implementation="paged")
    assert not [w for w in caught if "does not support" in str(w.message)]
    ref = stock.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.shape == (1, 3, 11)
    assert torch.equal(out[0], ref)


def test_failed_request_is_reported_and_others_finish(pair):
    _, fast = pair
    rows = [prompts(1)[0], list(range(3, 103)) * 3]  # the second is longer than the model's 256 positions
    with pytest.warns(UserWarning, match="failed"):
        res = fast.generate_batch(rows, _greedy(4, eos_token_id=None))
    assert res["req_0"].status == RequestStatus.FINISHED and len(res["req_0"].generated_tokens) == 4
    assert res["req_1"].status == RequestStatus.FAILED and "max_model_len" in res["req_1"].error


def test_unsupported_options_raise_and_beams_warn(pair):
    _, fast = pair
    with pytest.raises(ValueError, match="stop_strings"):
        fast.generate_batch(prompts(1), GenerationConfig(max_new_tokens=3, stop_strings=["x"]))
    with pytest.warns(UserWarning, match="num_beams"):
        res = fast.generate_batch(prompts(1), GenerationConfig(max_new_tokens=3, num_beams=2, eos_token_id=None))
    assert len(res["req_0"].generated_tokens) == 3


def test_manager_add_get_iter_cancel_stop(pair):
    stock, fast = pair
    rows = prompts(3)
    manager = fast.init_continuous_batching(_greedy(5, eos_token_id=None))
    cancelled = manager.add_request(rows[2], request_id="gone", max_new_tokens=200)
    manager.cancel_request("gone")  # before start: the engine drops it before computing anything
    manager.start()
    assert manager.is_running()
    first = manager.add_request(rows[0])
    mine = manager.add_request(rows[1], request_id="mine", max_new_tokens=3)
    assert (first, mine, cancelled) == ("req_0", "mine", "gone")
    out = manager.get_result(request_id="mine", timeout=30)
    assert out.request_id == "mine" and out.generated_tokens == _stock_alone(stock, rows[1], max_new_tokens=3)
    outs = list(manager.request_id_iter(first))
    assert [o.request_id for o in outs] == ["req_0"] and outs[0].is_finished()
    assert outs[0].generated_tokens == _stock_alone(stock, rows[0], max_new_tokens=5, eos_token_id=None)
    manager.stop(block=True, timeout=30)
    assert not manager.is_running()
    assert manager.get_result(timeout=0.1) is None  # the cancelled request produced no output
    with pytest.warns(UserWarning, match="stopping"):
        assert manager.add_request(rows[0]) is None
    assert not state_of(fast).engine.is_running()  # the last manager released the engine's loop


def test_streaming_outputs_grow_token_by_token(pair):
    _, fast = pair
    with fast.continuous_batching_context_manager(_greedy(5, eos_token_id=None)) as manager:
        rid = manager.add_request(prompts(1)[0], streaming=True, record_timestamps=True)
        outs = list(manager.request_id_iter(rid))
    assert [o.status for o in outs] == [RequestStatus.DECODING] * 4 + [RequestStatus.FINISHED]
    assert [len(o.generated_tokens) for o in outs] == [1, 2, 3, 4, 5]
    final = outs[-1].generated_tokens
    assert all(o.generated_tokens == final[:len(o.generated_tokens)] for o in outs)
    assert [len(o.timestamps) for o in outs] == [1, 2, 3, 4, 5]


def test_managers_share_the_engine_loop_and_iterate(pair):
    _, fast = pair
    a = fast.init_continuous_batching(_greedy(3, eos_token_id=None))
    b = fast.init_continuous_batching(_greedy(3, eos_token_id=None))
    a.start()
    b.start()
    a.stop()
    assert b.is_running()
    b.add_requests(prompts(2))
    got = []
    for out in b:
        got.append(out.request_id)
        if len(got) == 2:
            b.stop(block=False)
    b.join(timeout=30)
    assert sorted(got) == ["req_0", "req_1"] and not b.is_running()


def test_register_result_handler(pair):
    _, fast = pair

    async def run():
        manager = fast.init_continuous_batching(_greedy(4, eos_token_id=None))
        manager.start()
        seen, done = [], asyncio.Event()

        def on_result(out):
            seen.append(out)
            if out.is_finished():
                done.set()

        manager.register_result_handler("r", on_result)
        manager.add_request(prompts(1)[0], request_id="r", streaming=True)
        await asyncio.wait_for(done.wait(), 30)
        manager.stop()
        return seen

    seen = asyncio.run(run())
    assert [len(o.generated_tokens) for o in seen] == [1, 2, 3, 4]


def test_unoptimize_restores_stock_methods():
    model = llmplug.optimize(make_model("llama"))
    assert model.generate_batch.__func__ is not type(model).generate_batch
    model.generate_batch(prompts(1), _greedy(2, eos_token_id=None))
    engine = state_of(model).engine
    manager = model.init_continuous_batching(_greedy(2))
    manager.start()
    assert engine.is_running()
    llmplug.unoptimize(model)
    assert not engine.is_running()
    for name in ("generate_batch", "init_continuous_batching", "continuous_batching_context_manager", STATE_ATTR):
        assert name not in model.__dict__
    assert model.generate_batch.__func__ is type(model).generate_batch
    assert model.init_continuous_batching.__func__ is type(model).init_continuous_batching

