"""The test setup itself: Triton's interpreter only where there is no CUDA (so README's test command compiles the GPU
tests on a GPU machine), and the CPU tests that need the interpreter skip, not fail, when it is off."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cuda, expected", [(False, "1"), (True, None)])
def test_interpreter_only_without_cuda(cuda, expected):
    """conftest on a machine with (monkeypatched) or without CUDA, TRITON_INTERPRET unset beforehand."""
    code = (f"import torch; torch.cuda.is_available = lambda: {cuda}; import tests.conftest, os, sys; "
            "print(os.environ.get('TRITON_INTERPRET'), 'triton' in sys.modules)")
    proc = _run(["-c", code], {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(expected), "False"]  # decided before anything imports triton


def test_interpreter_dependent_tests_skip_when_it_is_off():
    """As on a GPU machine: interpreted CPU kernels (``cpu_kernels(True)``) and CPU opcheck / compile of the
    interpreter's opaque ops skip with the reason; the reference-path cases of the same files still run."""
    nodes = ["tests/ops/test_decode_slots.py::test_kernel_matches_reference",
             "tests/ops/test_decode_slots.py::test_reference_semantics",
             "tests/ops/test_prefill_attention.py::test_opcheck"]
    proc = _run(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *nodes], {"TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "1 passed, 19 skipped" in proc.stdout, proc.stdout[-3000:]
    assert "TRITON_INTERPRET=1" in proc.stdout  # the skip reason says what turns the tests on


@pytest.mark.parametrize("given, expected", [(None, "1 1"), ("2", "2 2")])
def test_one_intra_op_thread_unless_given(given, expected):
    """The tests' tiny ops run on one thread (an OpenMP region per op stalls when another process holds a core);
    ``OMP_NUM_THREADS`` given by the caller wins."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if given is not None:
        env["OMP_NUM_THREADS"] = given
    code = "import tests.conftest, os, torch; print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == expected
