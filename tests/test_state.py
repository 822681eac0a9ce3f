"""One owner of a model's llmplug state (``llmplug.state``): one attribute, removed by unoptimize; the step lock held by
whoever drives the runner; no module below the API imports it."""

import ast
import pathlib
import threading

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import llmplug
from llmplug.ops._triton import cpu_kernels
from llmplug.state import STATE_ATTR, require_state, state_of
from tests.tiny_models import make_model, prompts

PACKAGE = pathlib.Path(llmplug.__file__).parent


@pytest.fixture(autouse=True)
def _references():
    with cpu_kernels(False):
        yield


def _held_elsewhere(lock) -> bool:
    """Whether another thread could not take ``lock`` now."""
    got = []

    def try_lock():
        got.append(lock.acquire(timeout=0.05))
        if got[0]:
            lock.release()

    t = threading.Thread(target=try_lock)
    t.start()
    t.join()
    return not got[0]


def test_one_attribute_holds_the_state_and_unoptimize_removes_it():
    model = make_model("llama")
    before = set(model.__dict__)
    llmplug.optimize(model)
    added = set(model.__dict__) - before
    assert {k for k in added if k.startswith("_llmplug")} == {STATE_ATTR}
    state = state_of(model)
    assert state.config == llmplug.OptimizeConfig() and state.runner.model is model
    llmplug.unoptimize(model)
    assert set(model.__dict__) == before and state_of(model) is None
    with pytest.raises(RuntimeError, match="not optimized"):
        require_state(model)


def test_generate_holds_the_step_lock():
    model = llmplug.optimize(make_model("llama"))
    lock = require_state(model).step_lock
    seen = []

    class Probe(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(_held_elsewhere(lock))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model.generate(input_ids=torch.tensor([prompts(1)[0]]), max_new_tokens=3, do_sample=False,
                   stopping_criteria=StoppingCriteriaList([Probe()]))
    assert seen == [True, True, True]
    assert not _held_elsewhere(lock)


def test_engine_steps_hold_the_step_lock():
    model = make_model("llama")
    engine = llmplug.Engine(model)  # optimizes a plain model through the state layer
    lock = require_state(model).step_lock
    seen = []
    engine.add_request(prompts(1)[0], llmplug.SamplingParams(max_new_tokens=2),
                       on_event=lambda item: seen.append(_held_elsewhere(lock)))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen and all(seen)


def test_no_runtime_module_imports_the_api():
    """The engine and the state sit below ``llmplug.api``: none imports it, not even inside a function."""
    for path in [*(PACKAGE / "engine").glob("*.py"), PACKAGE / "state.py", *(PACKAGE / "patches").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = {node.module or ""} | {a.name for a in node.names}
                assert "api" not in names and not (node.module or "").endswith(".api"), (path.name, node.lineno)


STEP_MODULES = ("engine", "engine_spec", "engine_ring", "engine_draft", "engine_eagle", "sampler", "scheduler", "step",
                "page_table", "packed_graphs", "request")


def test_the_engine_step_makes_no_blocking_host_copy():
    """``torch.tensor(values, device=...)`` and ``.to(device)`` of host data wait for the GPU stream (a pageable copy),
    which would stall the Engine's step-ahead pipeline: its step modules send host data with ``device_tensor`` /
    ``to_device`` (pinned memory, non-blocking)."""
    for name in STEP_MODULES:
        path = PACKAGE / "engine" / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            call, kwargs = node.func, {k.arg for k in node.keywords}
            if call.attr in ("tensor", "as_tensor") and "device" in kwargs:
                raise AssertionError(f"{path.name}:{node.lineno} torch.{call.attr}(..., device=...) blocks the host")
            to_device = node.args and "dev" in ast.unparse(node.args[0])  # (a dtype conversion stays on the device)
            if call.attr == "to" and to_device and "non_blocking" not in kwargs and name != "step":
                raise AssertionError(f"{path.name}:{node.lineno} .to(...) without non_blocking may block the host")
