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


def _e2e_result(**extra) -> dict:
    agree = {"rows_identical": 1.0, "teacher_forced_argmax": 1.0}
    r = {"model": "tiny-llama", "dtype": "torch.float32", "new_tokens": 32, "weight_bytes": 3e7,
         "stock_eager_b1": {"median": 0.2}, "llmplug_b1": {"median": 0.25}, "batch_prompts": (32, 256),
         "llmplug_batches": {8: {"median": 1.0}}, "batch_output_tokens": {8: 256}, "llmplug_warmup_s": 0.4,
         "llmplug_vs_sdpa": agree, "stock_eager_vs_sdpa": agree}
    return {**r, **extra}


def test_e2e_table_says_skipped_where_a_baseline_did_not_run():
    from llmplug.bench.report import e2e_table

    text = "\n".join(e2e_table(_e2e_result(), {}))
    assert "nan" not in text.lower()
    b1 = next(line for line in text.splitlines() if line.startswith("batch-1 decode"))
    assert b1.split()[-5:] == ["160.0", "skipped", "128.0", "0.80x", "-"]
    batch = next(line for line in text.splitlines() if line.startswith("static batch 8"))
    assert batch.split()[-3:] == ["skipped", "256.0", "-"]
    assert "warm-up s: stock static+compile skipped, llmplug 0.4" in text


def test_e2e_table_with_every_baseline():
    from llmplug.bench.report import e2e_table

    r = _e2e_result(stock_static_compile_b1={"median": 0.1}, stock_batches={8: {"median": 2.0}},
                    stock_static_compile_warmup_s=30.0)
    lines = e2e_table(r, {})
    assert next(line for line in lines if line.startswith("batch-1 decode")).split()[-5:] == \
        ["160.0", "320.0", "128.0", "0.40x", "-"]
    assert next(line for line in lines if line.startswith("static batch 8")).split()[-3:] == ["128.0", "256.0", "2.00x"]
    assert "warm-up s: stock static+compile 30.0, llmplug 0.4" in lines
