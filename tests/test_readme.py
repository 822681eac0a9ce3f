"""README's Python snippets run as written, each on its own in a fresh interpreter, on the CPU (where a GPU is not
needed) and beside a checkout's ``models/`` (the shipped trained model stands in for ``name``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
# a snippet holding one of these needs what a test cannot have; nothing else is skipped
NEEDS = {"path/to/": "needs a GPTQ or AWQ checkpoint, which is a download"}


def test_readme_has_its_snippets():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("code", BLOCKS, ids=[f"snippet{i}" for i in range(len(BLOCKS))])
def test_snippet_runs_as_written(code, tmp_path):
    for marker, reason in NEEDS.items():
        if marker in code:
            pytest.skip(reason)
    (tmp_path / "models").symlink_to(ROOT / "models")  # what a checkout has; files the snippet writes stay here
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it: the CPU reference path
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
