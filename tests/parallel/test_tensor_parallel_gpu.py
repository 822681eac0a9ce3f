"""Tensor parallelism on two GPUs (NCCL, CUDA graphs on), fp32: the same tokens as one GPU, whichever all-reduce."""

import pytest
import torch

import llmplug
from tests.parallel.ranks import run_ranks
from tests.tiny_models import make_model, pad, prompts

pytestmark = pytest.mark.gpu


def _model():
    torch.manual_seed(0)
    return make_model("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2).cuda()


def _inputs():
    ids, mask = pad(prompts(4, lengths=(5, 11, 8, 3), vocab=120))
    return dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=24, do_sample=False)


def _on_ranks(rank: int, allreduce: str) -> dict:
    import os

    os.environ["LLMPLUG_TP_ALLREDUCE"] = allreduce
    model = llmplug.optimize(_model(), tensor_parallel="auto", graph_batch_sizes=(1, 4))
    out = {"batch": model.generate(**_inputs()).cpu(),
           "one": model.generate(**{k: v[:1] for k, v in _inputs().items() if k != "max_new_tokens"},
                                 max_new_tokens=24).cpu()}
    engine = llmplug.Engine(model)
    rows = [[t for t in r if t] for r in _inputs()["input_ids"].tolist()]
    if rank == 0:
        done = engine.generate(rows, llmplug.SamplingParams(max_new_tokens=24, temperature=0.0), progress=False)
        engine.release_followers()
        out["engine"] = [o.outputs[0].token_ids for o in done]
    else:
        out["engine"] = [o.outputs[0].token_ids for o in sorted(engine.follow(), key=lambda o: o.request_id)]
    out["graphs"] = len(llmplug.state.state_of(model).runner._graphs)
    llmplug.unoptimize(model)
    return out


@pytest.mark.parametrize("allreduce", ["nccl", "one_shot"])
def test_two_gpus_equal_one(allreduce):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    results = run_ranks(2, _on_ranks, allreduce, backend="nccl")
    solo = llmplug.optimize(_model(), graph_batch_sizes=(1, 4))
    expected = solo.generate(**_inputs()).cpu()
    one = solo.generate(**{k: v[:1] for k, v in _inputs().items() if k != "max_new_tokens"}, max_new_tokens=24).cpu()
    for got in results:
        assert torch.equal(got["batch"], expected) and torch.equal(got["one"], one)
        assert got["graphs"] > 0  # the steps replayed CUDA graphs with the collectives inside
        assert got["engine"] == results[0]["engine"]
