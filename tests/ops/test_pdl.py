"""Programmatic dependent launch gating: only inside a model step, only for CUDA tensors on sm_90+."""

import re
from pathlib import Path

import pytest
import torch

import llmplug
from llmplug.ops._triton import pdl_options, programmatic_launch


def test_cpu_and_outside_a_step_launch_plainly():
    x = torch.zeros(4)
    assert pdl_options(x) == {"PDL": False}
    with programmatic_launch():
        assert pdl_options(x) == {"PDL": False}  # the interpreter and the CPU never take launch_pdl


@pytest.mark.gpu
def test_cuda_step_scope(monkeypatch):
    x = torch.zeros(4, device="cuda")
    assert pdl_options(x) == {"PDL": False}
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    with programmatic_launch():
        assert pdl_options(x) == ({"PDL": True, "launch_pdl": True} if hopper else {"PDL": False})
        monkeypatch.setenv("LLMPLUG_PDL", "0")
        assert pdl_options(x) == {"PDL": False}
        with programmatic_launch(False):
            monkeypatch.delenv("LLMPLUG_PDL")
            assert pdl_options(x) == {"PDL": False}


def test_pdl_keywords_come_only_from_pdl_options():
    """A kernel may start before its input is written (``launch_pdl``) only if its code waits (``PDL=True``).
    ``pdl_options`` returns the two together, so no launch site may set either itself: a launch that merged
    ``{"PDL": False}`` into ``pdl_options()`` once kept ``launch_pdl=True`` and read stale inputs (BENCHMARKS.md)."""
    root = Path(llmplug.__file__).parent
    pattern = re.compile(r"launch_pdl|[\"']PDL[\"']|\bPDL\s*=(?!=)")
    offenders = [f"{path.relative_to(root)}:{i}: {line.strip()}"
                 for path in sorted(root.rglob("*.py")) if path.name != "_triton.py"
                 for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line.split("#")[0])]
    assert not offenders, "set PDL / launch_pdl only through pdl_options():\n" + "\n".join(offenders)
