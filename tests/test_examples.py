"""The scripts in ``examples/`` run with their default arguments (tiny random models, no downloads)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

EXPECTED = {
    "generate.py": ["outputs equal: True", "stock generate:", "llmplug generate:"],
    "pipeline_chat.py": ["assistant (assistant):", "same reply as stock pipeline: True"],
    "options.py": ["optimized: True", "ValueError: kv_block_size=12", "sampled twice with seed 0, equal: True",
                   "8 score tensors", "streamed: ", "fallback warning: llmplug does not support beam_search"],
}


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(script):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CPU reference path, not Triton's
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for text in EXPECTED[script]:
        assert text in proc.stdout, f"{text!r} not in stdout:\n{proc.stdout}"
