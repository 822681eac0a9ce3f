import pytest
import torch
import torch.nn.functional as F

import llmplug
from llmplug.ops import _cublaslt, tuned_gemm
from llmplug.state import state_of
from tests.tiny_models import make_model


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(tuned_gemm, "_measured", {})


def test_cpu_weights_are_never_tuned():
    w = torch.randn(48, 32)
    assert tuned_gemm.tune({(48, 32): [w, torch.randn(48, 32)]}, 16) == {}
    assert tuned_gemm.choices() == {}
    assert not _cublaslt.available()


def test_gemm_tuning_must_be_a_bool():
    with pytest.raises(ValueError, match="gemm_tuning='yes' must be True or False"):
        llmplug.OptimizeConfig(gemm_tuning="yes")
    assert llmplug.OptimizeConfig().gemm_tuning is False


def test_plain_linears_by_shape():
    model = make_model("llama")
    llmplug.optimize(model)
    decoder = state_of(model).runner.forward_fn
    groups = {shape: [lin.weight for lin in lins] for shape, lins in decoder.plain_linears().items()}
    text = model.config
    layers, hidden, inter = text.num_hidden_layers, text.hidden_size, text.intermediate_size
    head_dim = hidden // text.num_attention_heads
    qkv = (text.num_attention_heads + 2 * text.num_key_value_heads) * head_dim
    want = [((qkv, hidden), layers), ((hidden, hidden), layers), ((2 * inter, hidden), layers),
            ((hidden, inter), layers), ((text.vocab_size, hidden), 1)]
    counts: dict = {}
    for shape, count in want:  # shapes may coincide in a tiny config
        counts[shape] = counts.get(shape, 0) + count
    assert {shape: len(ws) for shape, ws in groups.items()} == counts
    assert all(w.shape == shape for shape, ws in groups.items() for w in ws)
    assert groups[(text.vocab_size, hidden)][-1] is model.lm_head.weight
    decoder.tune_gemms(16)  # CPU: nothing chosen, nothing kept
    assert all(not lin.tuned for lins in decoder.plain_linears().values() for lin in lins)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 100])
def test_lt_algorithms_against_linear_cuda(m):
    n, k = 1536, 1024
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
    want = F.linear(x.float(), w.float())
    plan = _cublaslt.LtMatmul(m, n, k, torch.bfloat16)
    heuristics = plan.heuristics(4)
    assert heuristics
    workspace = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    algos = heuristics + [a for a in plan.variants(heuristics[0], (2, 4), (1,)) if a.workspace <= workspace.numel()]
    for algo in algos:
        out = plan(x, w, torch.empty(m, n, dtype=torch.bfloat16, device="cuda"), algo, workspace)
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_tune_then_matmul_cuda():
    m, n, k = 64, 2048, 4096
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5 for _ in range(8)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    found = tuned_gemm.tune({(n, k): weights}, m)
    assert tuned_gemm.tune({(n, k): weights}, 300) == {}  # past MAX_ROWS: nothing timed
    key = (x.device.index, torch.bfloat16, m, n, k)
    assert list(tuned_gemm.choices()) == [key]
    choice = tuned_gemm.choices()[key]
    assert found == ({} if choice is None else {(n, k): choice})
    if choice is None:
        return
    assert choice.us <= tuned_gemm.MARGIN * choice.linear_us
    got = tuned_gemm.matmul(choice, x, weights[3])
    torch.testing.assert_close(got.float(), F.linear(x.float(), weights[3].float()), rtol=2e-2, atol=2e-2)
    assert torch.equal(got, tuned_gemm.matmul(choice, x, weights[3]))
    assert tuned_gemm.matmul(choice, x[:32], weights[3]) is None  # another row count than the choice's
    assert tuned_gemm.matmul(choice, x.t().contiguous().t(), weights[3]) is None  # not row-major
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tuned_gemm.matmul(choice, x, weights[3])
    graph.replay()
    assert torch.equal(captured, got)


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", [True, False])
def test_runner_tunes_its_graph_sizes_cuda(tuning):
    model = make_model("llama", dtype=torch.bfloat16).cuda()
    llmplug.optimize(model, gemm_tuning=tuning, graph_batch_sizes=(1, 16), packed_graph_tokens=())
    prompts = [[5, 6, 7, 8]] * 12
    out = model.generate(torch.tensor(prompts, device="cuda"), max_new_tokens=4, do_sample=False)
    assert out.shape == (12, 8)
    assert {key[2] for key in tuned_gemm.choices()} == ({16} if tuning else set())
    lins = [lin for lins in state_of(model).runner.forward_fn.plain_linears().values() for lin in lins]
    assert all(set(lin.tuned) <= {16} for lin in lins)
    if not tuning:
        assert all(not lin.tuned for lin in lins)
    other = make_model("llama", dtype=torch.bfloat16).cuda()  # the same shapes, tuning off: the timings stay unused
    llmplug.optimize(other, graph_batch_sizes=(1, 16), packed_graph_tokens=())
    other.generate(torch.tensor(prompts, device="cuda"), max_new_tokens=4, do_sample=False)
    assert all(not lin.tuned for lins in state_of(other).runner.forward_fn.plain_linears().values() for lin in lins)
