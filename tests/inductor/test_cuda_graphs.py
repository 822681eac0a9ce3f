"""The backend's own CUDA graphs (:mod:`llmplug.inductor.cuda_graphs`) on the CPU, through a stand-in graph that
records each op at capture bound to the tensors it was given and runs them again on replay (what a CUDA graph does):
warm-up, capture, replay with the call's inputs copied in and back out, static inputs written in place, copied outputs,
one graph per set of static addresses, and the calls it runs without a graph."""

import contextlib

import pytest
import torch

from llmplug.inductor import cuda_graphs
from llmplug.inductor.cuda_graphs import GraphedCall, why_not


class Graph:
    """Stand-in for ``torch.cuda.CUDAGraph``."""

    capturing = None
    made = 0

    def __init__(self) -> None:
        self.work = []
        Graph.made += 1

    @contextlib.contextmanager
    def capture(self):
        Graph.capturing = self
        try:
            yield
        finally:
            Graph.capturing = None

    def replay(self) -> None:
        for work in self.work:
            work()


def op(fn, out: torch.Tensor) -> torch.Tensor:
    """``out.copy_(fn())`` now, or at each replay of the graph being captured."""
    if Graph.capturing is not None:
        Graph.capturing.work.append(lambda: out.copy_(fn()))
    else:
        out.copy_(fn())
    return out


def step(w, cache, x, counter):
    """A decode step's shape: reads a weight, writes a static cache, writes a non-static input, returns two tensors."""
    y = op(lambda: x @ w, torch.empty(x.shape[0], w.shape[1]))
    op(lambda: cache + y.sum(), cache)  # a static input written in place
    op(lambda: counter + 1, counter)  # a non-static input written: the caller's tensor must see it
    return [op(lambda: y * 2, torch.empty_like(y)), op(lambda: cache * 1, torch.empty_like(cache))]


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(5, 3, generator=g), requires_grad=False)
    cache = torch.zeros(4)
    torch._dynamo.mark_static_address(cache)
    return w, cache


@pytest.fixture(autouse=True)
def _graphs():
    Graph.made = 0
    yield


def test_replays_give_the_plain_calls_results_and_write_inputs_where_the_graph_writes_them():
    w, cache = _inputs()
    w_ref, cache_ref = w.detach().clone(), cache.clone()
    counter, counter_ref = torch.zeros(1), torch.zeros(1)
    call = GraphedCall(step, [w, cache, torch.randn(2, 5), counter], new_graph=Graph)
    kept = []
    for i in range(5):
        x = torch.randn(2, 5, generator=torch.Generator().manual_seed(i))
        got = call(w, cache, x, counter)
        expected = step(w_ref, cache_ref, x.clone(), counter_ref)
        kept.append((got, [e.clone() for e in expected]))
        assert isinstance(got, list)
        torch.testing.assert_close(cache, cache_ref)
        torch.testing.assert_close(counter, counter_ref)
    assert Graph.made == 1  # call 1 warmed up, call 2 captured, the rest replayed
    for got, expected in kept:  # earlier outputs are copies: later replays left them alone
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e)


def test_a_graph_for_each_set_of_static_addresses_the_oldest_dropped(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 2)
    w, _ = _inputs()
    caches = [_inputs()[1] for _ in range(3)]
    call = GraphedCall(step, [w, caches[0], torch.randn(2, 5), torch.zeros(1)], new_graph=Graph)
    x = torch.randn(2, 5)
    call(w, caches[0], x, torch.zeros(1))  # warm-up
    for cache in (caches[0], caches[1], caches[0], caches[1]):
        expected = step(w, cache.clone(), x, torch.zeros(1))
        torch.testing.assert_close(call(w, cache, x, torch.zeros(1)), expected)
    assert Graph.made == 2  # one a cache, each replayed when its cache came back
    call(w, caches[2], x, torch.zeros(1))
    assert Graph.made == 3 and len(call.graphs) == 2
    call(w, caches[1], x, torch.zeros(1))  # kept: used more recently than caches[0]'s
    assert Graph.made == 3
    call(w, caches[0], x, torch.zeros(1))
    assert Graph.made == 4


@pytest.mark.parametrize("case", ["view of an input", "capture fails", "outputs share memory", "inputs share memory"])
def test_what_a_graph_cannot_take_runs_without_one_after_a_warning(case):
    def returns_a_view(w, cache, x):
        return [op(lambda: x * 1, x)[:1]]

    def fails(w, cache, x):
        if Graph.capturing is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return [x * 2]

    def shares(w, cache, x):
        y = op(lambda: x * 2, torch.empty_like(x))
        return [y, y[1:]]

    def writes_a_view_of_the_cache(w, cache, x):  # x: a non-static view of the static cache
        op(lambda: x + 1, x)
        return [op(lambda: cache * 2, torch.empty_like(cache))]

    fn = {"view of an input": returns_a_view, "capture fails": fails, "outputs share memory": shares,
          "inputs share memory": writes_a_view_of_the_cache}[case]
    w, cache = _inputs()
    call = GraphedCall(fn, [w, cache, torch.randn(2, 5)], new_graph=Graph)
    x = cache[:2] if case == "inputs share memory" else torch.randn(2, 5)
    call(w, cache, x)
    expected_cache = cache.clone()
    with pytest.warns(UserWarning, match="without CUDA graphs"):
        got = call(w, cache, x)
    if case == "inputs share memory":  # the write through the view reached the cache, and the output saw it
        expected_cache[:2] += 1
        torch.testing.assert_close(cache, expected_cache)
        torch.testing.assert_close(got[0], cache * 2)
    else:
        torch.testing.assert_close(got, fn(w, cache, x.clone()))
    assert call.ungraphed is not None and call.graphs == []
    assert len(call(w, cache, x)) == len(got)  # no second warning, still right


def test_which_graphs_are_left_to_inductors_trees():
    assert why_not([torch.zeros(2)]) == "inputs not all on one CUDA device"
    assert why_not([torch.zeros(2), 3]) == "non-tensor inputs (dynamic shapes)"
    if torch.cuda.is_available():
        x = torch.zeros(2, device="cuda", requires_grad=True)
        assert why_not([x]) == "a graph autograd records"
        with torch.no_grad():
            assert why_not([x]) is None


@pytest.mark.gpu
def test_real_cuda_graphs_replay_a_compiled_step():
    """``torch.cuda.CUDAGraph`` itself under :class:`GraphedCall`: an Inductor-compiled step that writes a static
    cache in place and a non-static input, over several calls and two caches, equals the step run eagerly."""
    import torch._inductor.config as inductor_config

    def f(w, cache, x, counter):
        cache.add_(x @ w)
        counter.add_(1)
        return (torch.relu(cache) * 2,)

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 8, device="cuda"), requires_grad=False)
    caches = [torch.zeros(4, 8, device="cuda") for _ in range(2)]
    for c in caches:
        torch._dynamo.mark_static_address(c)
    with inductor_config.patch({"triton.cudagraphs": False}):
        compiled = torch._inductor.compile(torch.fx.symbolic_trace(f),
                                           [w, caches[0].clone(), torch.randn(4, 16, device="cuda"),
                                            torch.zeros(1, device="cuda")])
    call = GraphedCall(compiled, [w, caches[0], torch.randn(4, 16, device="cuda"), torch.zeros(1, device="cuda")])
    refs = [c.clone() for c in caches]
    counter, counter_ref = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    for i in range(6):
        x = torch.randn(4, 16, device="cuda")
        got = call(w, caches[i % 2], x, counter)
        expected = f(w, refs[i % 2], x, counter_ref)
        torch.testing.assert_close(got[0], expected[0])
        torch.testing.assert_close(caches[i % 2], refs[i % 2])
    torch.testing.assert_close(counter, counter_ref)
    assert len(call.graphs) == 2 and call.ungraphed is None


@pytest.mark.gpu
def test_hf_static_generate_through_the_backends_own_graphs(monkeypatch):
    """Stock ``generate(cache_implementation="static", compile_config=CompileConfig(backend="llmplug"))`` in fp32 on
    the GPU: the decode steps replay llmplug's graphs, and the greedy tokens are those of the same backend under
    Inductor's trees (``LLMPLUG_CUDAGRAPH_TREES=1``: the same compiled kernels), over calls of two lengths (each a new
    static cache) and a repeat of the first."""
    from transformers import CompileConfig

    import llmplug.inductor
    from tests.tiny_models import make_model, pad, prompts

    llmplug.inductor.register()  # a checkout on PYTHONPATH has no installed entry point
    made = []
    real = cuda_graphs.GraphedCall.__init__
    monkeypatch.setattr(cuda_graphs.GraphedCall, "__init__",
                        lambda self, *a, **k: made.append(self) or real(self, *a, **k))
    torch.manual_seed(0)
    model = make_model("llama").cuda()
    ids, mask = (t.cuda() for t in pad(prompts(2, lengths=(3, 7), vocab=120)))
    tokens = {}
    for trees in ("1", "0"):
        monkeypatch.setenv("LLMPLUG_CUDAGRAPH_TREES", trees)
        torch._dynamo.reset()
        tokens[trees] = [model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                        cache_implementation="static", compile_config=CompileConfig(backend="llmplug"))
                         for new in (9, 5, 9)]
        assert bool(made) == (trees == "0")
    torch._dynamo.reset()
    for got, expected in zip(tokens["0"], tokens["1"], strict=True):
        assert torch.equal(got, expected)
    assert all(call.ungraphed is None for call in made) and all(call.graphs for call in made)
