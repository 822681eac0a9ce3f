"""The commit recorded with benchmark results."""

import shutil
import subprocess

import pytest

from llmplug.bench.report import git_commit


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_commit_marks_a_dirty_tree_and_gives_none_without_history(tmp_path, monkeypatch):
    import llmplug.bench.report as report

    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(tmp_path, "init", "-q", str(repo))
    (repo / "pkg" / "f.py").write_text("a = 1\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    head = _git(repo, "rev-parse", "HEAD").strip()
    monkeypatch.setattr(report, "__file__", str(repo / "pkg" / "report.py"))
    assert git_commit() == head
    (repo / "pkg" / "f.py").write_text("a = 2\n")
    assert git_commit() == head + "+dirty"
    shutil.rmtree(repo / ".git" / "objects")  # refs without objects, as in a partial copy of a checkout
    assert git_commit() is None
