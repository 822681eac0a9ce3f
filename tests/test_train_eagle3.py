"""scripts/train_eagle3.py: its training-time-test unroll computes what the head computes when it drafts, and a tiny
CPU run writes a head that ``llmplug.load_eagle3`` loads for the shipped small model."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import llmplug
from llmplug.spec.eagle3 import HeadCache, load_eagle3
from tests.spec.test_eagle3 import LAYERS, _head_config, _head_tensors, _save
from tests.tiny_models import make_model, reference_kernels

ROOT = Path(__file__).resolve().parent.parent
SMALL = ROOT / "models" / "llmplug-stdlib-small"
TINY = ["--device", "cpu", "--max-files", "30", "--steps", "3", "--batch-size", "2", "--seq-len", "64",
        "--ttt-steps", "2", "--eval-prompts", "2", "--eval-new-tokens", "16", "--eval-depth", "4", "--e2e-prompts",
        "2"]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_eagle3", ROOT / "scripts" / "train_eagle3.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@torch.no_grad()
def test_training_unroll_equals_inference_drafting(script, tmp_path):
    """Step ``j`` of the training-time-test unroll at index ``t`` gives the logits the head gives at inference for the
    ``j``-th draft after the verified position ``t`` (the head's KV over positions ``0..t``, then one position a
    draft fed the window's token and the previous output): same positions, same attention."""
    target = make_model("llama", num_hidden_layers=LAYERS)
    config = _head_config()
    head = load_eagle3(_save(tmp_path / "head", config, _head_tensors(config)), target).head
    embed, depth = target.get_input_embeddings(), 5
    window = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    with reference_kernels():
        out = target(input_ids=window, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in (2, 4, 5)], dim=-1)
        steps = script.unroll(head, embed, window, aux, depth)
        for t in (0, 7, 16):
            cache = HeadCache(head)
            cache.reserve(1, t + depth)
            hidden = head(embed(window[:, 1:t + 2]), head.fc(aux[:, :t + 1]), torch.arange(t + 1)[None], cache, None,
                          t + 1)[:, -1]
            for j in range(depth):
                if j:
                    hidden = head(embed(window[:, t + 1 + j, None]), hidden[:, None], torch.tensor([[t + j]]), cache,
                                  None, t + j + 1)[:, 0]
                torch.testing.assert_close(steps[j][0, t], head.logits(hidden)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not (SMALL / "tokenizer.json").is_file(), reason="models/ is not in this checkout")
def test_tiny_cpu_run(script, tmp_path):
    out = tmp_path / "head"
    with reference_kernels():
        report = script.main(TINY + ["--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "train_report.json"]
    assert sum(p.stat().st_size for p in out.iterdir()) <= 5e6
    assert report["training"]["steps"] == 3 and report["aux_layers"] == [2, 4, 5]
    assert len(report["held_out"]["acceptance_per_position"]) == 4 and report["generate"]["identical"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    proposer = llmplug.load_eagle3(out, AutoModelForCausalLM.from_pretrained(SMALL))
    assert proposer.head.lm_head.weight.shape == (4096, 256) and proposer.head.lm_head.weight.dtype == torch.float32
