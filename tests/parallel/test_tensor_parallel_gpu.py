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


_ENGINE = llmplug.EngineConfig(max_num_batched_tokens=16, max_num_seqs=4)


def _first(inputs: dict) -> dict:
    """The first prompt of the batch alone."""
    return {k: v[:1] if torch.is_tensor(v) else v for k, v in inputs.items()}


def _on_ranks(rank: int, allreduce: str) -> dict:
    import os

    os.environ["LLMPLUG_TP_ALLREDUCE"] = allreduce
    model = llmplug.optimize(_model(), tensor_parallel="auto", graph_batch_sizes=(1, 4), packed_graph_tokens=(8, 32))
    out = {"batch": model.generate(**_inputs()).cpu(), "one": model.generate(**_first(_inputs())).cpu()}
    engine = llmplug.Engine(model, _ENGINE)
    engine.warmup(progress=False)  # every rank alike: the decode graphs, and the graphs of packed steps
    out["packed"] = llmplug.state.state_of(model).runner.packed_graphs.token_buckets
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
    """generate, and an Engine whose packed steps (a 16-token budget: prompt chunks beside decodes) replay graphs with
    the collectives inside, give one GPU's tokens."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    results = run_ranks(2, _on_ranks, allreduce, backend="nccl")
    solo = llmplug.optimize(_model(), graph_batch_sizes=(1, 4), packed_graph_tokens=(8, 32))
    expected = solo.generate(**_inputs()).cpu()
    one = solo.generate(**_first(_inputs())).cpu()
    engine = llmplug.Engine(solo, _ENGINE)
    engine.warmup(progress=False)
    rows = [[t for t in r if t] for r in _inputs()["input_ids"].tolist()]
    alone = engine.generate(rows, llmplug.SamplingParams(max_new_tokens=24, temperature=0.0), progress=False)
    for got in results:
        assert torch.equal(got["batch"], expected) and torch.equal(got["one"], one)
        assert got["graphs"] > 0  # the steps replayed CUDA graphs with the collectives inside
        assert got["packed"] == [8, 32]
        assert got["engine"] == [o.outputs[0].token_ids for o in alone]


def _reduce_on_ranks(rank: int, sizes: tuple[int, ...], dtype: torch.dtype) -> dict:
    """llmplug's one-shot all-reduce against NCCL on each size (eagerly, many calls in a row so the two slots take
    turns), then 40 calls in one CUDA graph replayed on fresh inputs."""
    import os

    import torch.distributed as dist

    from llmplug.parallel.group import TPGroup

    os.environ["LLMPLUG_TP_ALLREDUCE"] = "one_shot"
    group = TPGroup(rank, dist.get_world_size())
    group.prepare(torch.device("cuda"))
    assert group.one_shot is not None, "the one-shot buffer was not mapped"
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    worst = {}
    for n in sizes:
        for _ in range(3):
            x = torch.randn(n, generator=gen, device="cuda").to(dtype)
            want = x.clone()
            dist.all_reduce(want)
            got = group.all_reduce(x.clone())
            worst[n] = max(worst.get(n, 0.0), float((got.float() - want.float()).abs().max()))
    mixed = 0.0  # fp32 shares summed into a bf16 result (the row-parallel projections' way)
    for n in sizes[:4]:
        x = torch.randn(n, generator=gen, device="cuda")
        want = x.clone()
        dist.all_reduce(want)
        got = group.all_reduce(x, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16
        mixed = max(mixed, float((got.float() - want.to(torch.bfloat16).float()).abs().max()))
    worst["fp32 in, bf16 out"] = mixed
    xs = [torch.zeros(4096, dtype=dtype, device="cuda") for _ in range(40)]
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        group.all_reduce(xs[0].clone())  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for x in xs:
            group.all_reduce(x)
    replay_worst = 0.0
    for _ in range(5):
        fresh = [torch.randn(4096, generator=gen, device="cuda").to(dtype) for _ in xs]
        for x, f in zip(xs, fresh):
            x.copy_(f)
        graph.replay()
        for x, f in zip(xs, fresh):
            dist.all_reduce(f)
            replay_worst = max(replay_worst, float((x.float() - f.float()).abs().max()))
    torch.cuda.synchronize()
    return {"eager": worst, "graph": replay_worst}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_shot_all_reduce_equals_nccl(dtype):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    sizes = (1, 7, 4096, 4099, 40_000, 256 * 1024 // dtype.itemsize)  # odd sizes, several programs, a full slot
    for got in run_ranks(2, _reduce_on_ranks, sizes, dtype, backend="nccl", timeout=120):
        # two ranks: one rounding of the exact sum either way (NCCL in the dtype, llmplug from fp32)
        tolerance = 0.0 if dtype == torch.bfloat16 else 1e-6
        assert max(got["eager"].values()) <= tolerance, got
        assert got["graph"] <= tolerance, got


def _add_norm_on_ranks(rank: int, shapes, share_dtype) -> dict:
    import os

    import torch.distributed as dist

    from llmplug.ops.rms_norm import add_rms_norm
    from llmplug.parallel.group import TPGroup

    os.environ["LLMPLUG_TP_ALLREDUCE"] = "one_shot"
    group = TPGroup(rank, 2)
    group.prepare(torch.device("cuda"))
    assert group.one_shot is not None
    gen = torch.Generator(device="cuda").manual_seed(rank)  # each rank's own share; the residual the same everywhere
    same = torch.Generator(device="cuda").manual_seed(99)
    worst = {}
    for m, n, scale, offset in shapes:
        share = torch.randn(m, n, generator=gen, device="cuda").to(share_dtype)
        residual = torch.randn(m, n, generator=same, device="cuda").bfloat16()
        weight = torch.randn(n, generator=same, device="cuda").bfloat16()
        want = share.clone()
        dist.all_reduce(want)
        want = want.to(torch.bfloat16)
        if scale != 1.0:
            want = want * scale
        want_normed, want_total = add_rms_norm(want, residual, weight, 1e-5, offset, offset == 0.0)
        normed, total = group.one_shot.add_rms_norm(share, residual, weight, 1e-5, offset, offset == 0.0, scale)
        worst[(m, n, scale, offset)] = (float((total.float() - want_total.float()).abs().max()),
                                        float(((normed.float() - want_normed.float()).abs()
                                               / want_normed.float().abs().clamp_min(1e-3)).max()))
    torch.cuda.synchronize()
    return worst


@pytest.mark.parametrize("share_dtype", [torch.float32, torch.bfloat16])
def test_one_shot_add_rms_norm_equals_nccl_then_add_rms_norm(share_dtype):
    """The fused all-reduce + residual add + RMSNorm: the total bit for bit as NCCL's sum then ``add_rms_norm``, the
    norm within a bf16 rounding step (its mean square is summed in another order)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    shapes = ((1, 4096, 1.0, 0.0), (3, 2000, 0.5, 0.0), (32, 4096, 1.0, 1.0), (15, 8192, 1.0, 0.0))  # up to a slot
    for got in run_ranks(2, _add_norm_on_ranks, shapes, share_dtype, backend="nccl", timeout=120):
        for shape, (total_err, normed_rel) in got.items():
            assert total_err == 0.0, (shape, total_err)
            assert normed_rel <= 2 ** -7, (shape, normed_rel)
