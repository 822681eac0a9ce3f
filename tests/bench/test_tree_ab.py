"""benchmarks/tree_ab.py: a commit's package written out; trees' throughput runs alternated (A B, B A), each in its
own folder, a failed run reported rather than fatal (the benchmark command itself is faked here: it takes minutes)."""

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tree_ab():
    spec = importlib.util.spec_from_file_location("tree_ab", ROOT / "benchmarks" / "tree_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_prepare_writes_the_package(tmp_path, monkeypatch):
    tree_ab = _tree_ab()
    monkeypatch.chdir(ROOT)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    tree_ab.prepare(head, tmp_path / "head")
    for name in tree_ab.PACKAGE:
        assert (tmp_path / "head" / name).exists(), name
    committed = subprocess.run(["git", "show", f"{head}:llmplug/cli.py"], capture_output=True, check=True).stdout
    assert (tmp_path / "head" / "llmplug" / "cli.py").read_bytes() == committed


def test_run_alternates_and_reports_failures(tmp_path, monkeypatch):
    tree_ab = _tree_ab()
    calls = []

    def fake(cmd, cwd, capture_output, text):
        calls.append((Path(cwd).name, cmd))
        if Path(cwd).name == "broken":
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback: no module")
        out = Path(cmd[cmd.index("--out") + 1])
        out.write_text(json.dumps({"runs": {"a": {"wall_s": 1.5, "fraction_of_floor": 0.6}}}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(tree_ab.subprocess, "run", fake)
    trees = {"one": tmp_path / "one", "two": tmp_path / "two"}
    rows = tree_ab.run(trees, 3, ["--model", "llama-1b", "--workloads", "a"], tmp_path / "out")
    assert [name for name, _ in calls] == ["one", "two", "two", "one", "one", "two"]
    assert all(c[1:6] == ["-m", "llmplug.cli", "bench", "throughput", "--model"] and "--no-stock" in c
               for _, c in calls)
    assert [(r["pass"], r["tree"], r["wall_s"]) for r in rows] == [(1, "one", 1.5), (1, "two", 1.5), (2, "two", 1.5),
                                                                   (2, "one", 1.5), (3, "one", 1.5), (3, "two", 1.5)]
    calls.clear()
    tree_ab.run(trees, 1, ["--model", "m"], tmp_path / "out", {"two": ["--greedy-ring=16"]})
    assert [c[5:8] for _, c in calls] == [["--model", "m", "--no-stock"], ["--greedy-ring=16", "--model", "m"]]
    failed = tree_ab.run({"broken": tmp_path / "broken"}, 1, [], tmp_path / "out")
    assert failed == [{"pass": 1, "tree": "broken", "error": "Traceback: no module"}]
