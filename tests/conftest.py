"""Test setup: where there is no CUDA, Triton kernels run on CPU tensors through Triton's interpreter.

``TRITON_INTERPRET`` must be set before ``triton`` is first imported, hence here, at collection time (``import torch``
does not import triton). On a CUDA machine the interpreter stays off, so the GPU tests run compiled kernels; the CPU
tests that need the interpreter then skip: those marked ``interpreter`` and those asking for interpreted CPU kernels
(``cpu_kernels(True)`` raises :class:`~llmplug.ops._triton.InterpreterRequired`).
"""

import os

# NOTE: one intra-op thread: every tiny op that opens an OpenMP region stalls for a scheduler slice when another
# process holds a core (BENCHMARKS.md, "CPU threads beside a busy neighbour"). Set before torch loads OpenMP.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETER_OFF = ("needs Triton's interpreter on CPU: TRITON_INTERPRET=1, which this conftest sets only where there "
                   "is no CUDA")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device machine)")
    config.addinivalue_line("markers", "slow: long CPU test")
    config.addinivalue_line("markers", f"interpreter: {INTERPRETER_OFF}")


def pytest_collection_modifyitems(config, items):
    from llmplug.ops._triton import INTERPRET

    cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(pytest.mark.skip(reason=INTERPRETER_OFF))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that asks for interpreted CPU kernels while the interpreter is off skips, naming what it needs."""
    from llmplug.ops._triton import InterpreterRequired

    try:
        return (yield)
    except InterpreterRequired:
        pytest.skip(INTERPRETER_OFF)
