"""The scripts in ``examples/`` run with their default arguments (tiny random models, no downloads)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmplug.bench.sample import MODEL_NAME

ROOT = Path(__file__).resolve().parent.parent

SPECULATIVE = [f"{how}: equal to plain greedy: True" for how in (
    "generate, prompt lookup", "generate, draft model", "generate, EAGLE-3 head", "Engine, draft model",
    "generate_batch, prompt lookup")]
EXPECTED = {
    "generate.py": ["outputs equal: True", "stock generate:", "llmplug generate:"],
    "pipeline_chat.py": ["assistant (assistant):", "same reply as stock pipeline: True"],
    "tensor_parallel.py": ["ranks: 1; rank 0 holds 128 of 128 q_proj rows",
                           "greedy tokens equal to stock HF on the whole model: True"],
    "options.py": ["optimized: True", "ValueError: kv_block_size=12", "sampled twice with seed 0, equal: True",
                   "8 score tensors", "streamed: ", "fallback warning: llmplug does not support beam_search"],
}


def _run(script: str, *args: str, launcher: tuple[str, ...] = ()) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CPU reference path, not Triton's
    # on the CPU in fp32, where the scripts' "equal: True" must hold (on a GPU they run bf16: near-ties may round apart)
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *launcher, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(script):
    out = _run(script)
    for text in EXPECTED[script]:
        assert text in out, f"{text!r} not in stdout:\n{out}"


@pytest.mark.skipif(not (ROOT / "models" / MODEL_NAME).is_dir(), reason="models/ is not in this checkout")
def test_pipeline_chat_on_the_shipped_model():
    """The one local model a newcomer has: it has no chat template, so the example gives it a minimal one."""
    out = _run("pipeline_chat.py", "--model", f"models/{MODEL_NAME}")
    assert f"(models/{MODEL_NAME} has no chat template: using a minimal one)" in out
    assert "same reply as stock pipeline: True" in out


@pytest.mark.skipif(not (ROOT / "models" / "llmplug-stdlib-small-eagle3").is_dir(),
                    reason="models/ is not in this checkout")
def test_speculative_on_the_shipped_models():
    """Every way of drafting gives plain greedy decoding's tokens on the shipped models (fp32 CPU), and the draft model
    and the head get drafts accepted."""
    out = _run("speculative.py", "--max-new-tokens", "24")
    for text in SPECULATIVE:
        assert text in out, f"{text!r} not in stdout:\n{out}"
    for label in ("draft model", "EAGLE-3 head"):
        line = next(x for x in out.splitlines() if x.startswith(f"generate, {label}:"))
        accepted = int(line.split("; ")[1].split(" of ")[0])
        assert accepted > 0, line


def test_tensor_parallel_under_torchrun():
    """The README's torchrun recipe on two CPU processes (gloo): rank 0 holds half of each layer, same tokens."""
    out = _run("tensor_parallel.py", launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"))
    assert "ranks: 2; rank 0 holds 64 of 128 q_proj rows" in out, out
    assert "greedy tokens equal to stock HF on the whole model: True" in out, out
