"""Programmatic edges into the GEMM kernels that wait on the grid dependency (CUDA, sm_90+): the race tells a kernel
that waits from one that does not, and an Engine's tokens stay bitwise those of graphs with their edges as captured."""

import copy

import pytest
import torch
import torch.nn.functional as F

import llmplug
from llmplug import Engine, EngineConfig, SamplingParams
from llmplug.engine import graph_edges
from llmplug.ops._triton import triton
from llmplug.ops.rms_norm import rms_norm
from llmplug.state import state_of
from tests.tiny_models import make_model, prompts

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.get_device_capability() >= (9, 0)


def test_switches(monkeypatch):
    assert graph_edges.enabled()
    for var in ("LLMPLUG_PDL", "LLMPLUG_PDL_GEMMS"):
        monkeypatch.setenv(var, "0")
        assert not graph_edges.enabled()
        monkeypatch.delenv(var)


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="needs sm_90+")
def test_race_tells_waiting_from_not_waiting():
    api = graph_edges.GraphApi()
    x = torch.zeros(256, 2048, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def copy_no_wait(t):
        graph_edges.copy_no_wait[(triton.cdiv(t.numel(), 1024),)](t, y, t.numel(), BLOCK=1024)
        return y

    key, waited = graph_edges.race(api, copy_no_wait, x)
    assert "copy_no_wait" in key[0] and key[1] == (x.numel() // 1024, 1, 1) and not waited
    w = torch.rand(2048, device="cuda", dtype=torch.bfloat16) + 0.5
    key, waited = graph_edges.race(api, lambda t: rms_norm(t, w, 1e-5), x)
    assert "rms_norm" in key[0] and waited  # launched programmatically, it waits
    weight = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    key, _ = graph_edges.race(api, lambda t: F.linear(t, weight), x)
    assert key is not None and "spin" not in key[0]  # cuBLAS's kernel, waiting or not


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="needs sm_90+")
def test_engine_tokens_equal_with_and_without(monkeypatch):
    """bf16 (cuBLAS at 16+ rows, in the decode graphs of 16-32 rows and the packed graphs): bitwise the same tokens
    with the edges made programmatic as with the edges captured, and edges did change where a GEMM kernel waited."""
    torch.manual_seed(0)
    base = make_model("llama", dtype=torch.bfloat16, hidden_size=512, intermediate_size=1024,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64).cuda()
    base.generation_config.eos_token_id = None
    rows = prompts(40, lengths=(5, 30, 3, 41, 1, 19, 12, 7), seed=4)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("LLMPLUG_PDL_GEMMS", switch)
        fast = copy.deepcopy(base)
        llmplug.optimize(fast, kv_num_blocks=512, kv_block_size=16, graph_batch_sizes=(8, 16, 32, 64),
                         graph_prefill_tokens=(), packed_graph_tokens=(64, 128))
        engine = Engine(fast, EngineConfig(max_num_batched_tokens=128))
        engine.warmup()
        outs[switch] = [o.outputs[0].token_ids for o in engine.generate(rows, params, progress=False)]
        gemms = state_of(fast).runner._gemm_edges
        if switch == "0":
            assert gemms is None
        else:
            assert gemms is not None and gemms.unsupported is None and gemms.waits
            assert (gemms.edges_changed > 0) == any(gemms.waits.values())
    assert outs["0"] == outs["1"]
