"""Programmatic dependent launch gating: only inside a model step, only for CUDA tensors on sm_90+."""

import pytest
import torch

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
