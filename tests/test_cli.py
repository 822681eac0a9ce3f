"""``llmplug bench`` on CPU: timings on the trained model by default, then its text sample from stock HF and
llmplug; the fallback where the model is missing; the exit status when outputs differ."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmplug import cli
from llmplug.bench import e2e, sample
from tests.tiny_models import reference_kernels

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def _tiny():
    """One real ``e2e.run`` at the smallest scale on tiny-llama (timings on the trained model cost seconds more)."""
    with reference_kernels():
        yield e2e.run("tiny-llama", "cpu", torch.float32, new_tokens=2, static=False, ttft=False, batches=(2,),
                      repeats=1, batch_prompts=(32, 256))


@pytest.fixture(autouse=True)
def _references():
    with reference_kernels():
        yield


@pytest.fixture
def timed(monkeypatch, _tiny):
    """``e2e.run`` answered by the tiny-llama run; records which model and prompt range the CLI asked for."""
    asked = []

    def run(model, device, dtype, **kw):
        asked.append((model, kw["batch_prompts"]))
        return copy.deepcopy(_tiny)

    monkeypatch.setattr(e2e, "run", run)
    return asked


def test_default_is_the_trained_model_with_text(timed, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["bench", "--device", "cpu", "--out", str(out)]) == 0
    assert timed == [(str(sample.default_model()), (32, 256))]
    text = capsys.readouterr().out
    assert "## tiny-llama (torch.float32" in text and "static batch 2 output tok/s (32-256 in)" in text
    assert f"## text sample: {sample.MODEL_NAME} (8.4M parameters), greedy, 32 new tokens, torch.float32" in text
    for prompt in sample.PROMPTS:
        assert f"--- stock HF, prompt {prompt!r}\n{prompt}" in text
        assert f"--- llmplug, prompt {prompt!r} (identical to stock HF)\n{prompt}" in text
    assert text.rstrip().endswith("greedy outputs identical to stock HF: yes")
    saved = json.loads(out.read_text())
    assert saved["sample"]["identical"] and len(saved["sample"]["samples"]) == len(sample.PROMPTS)
    assert all(s["stock"] == s["llmplug"] and s["stock"] for s in saved["sample"]["samples"])
    assert text.index("## text sample") < text.index(saved["sample"]["samples"][-1]["stock"])


def test_without_the_trained_model(timed, monkeypatch, capsys):
    monkeypatch.setattr(sample, "default_model", lambda: None)
    assert cli.main(["bench", "--device", "cpu"]) == 0
    assert timed == [("tiny-llama", (32, 256))]
    text = capsys.readouterr().out
    notes = [line for line in text.splitlines() if line.startswith("(no text sample")]
    assert notes == [f"(no text sample: models/{sample.MODEL_NAME} is not beside the package, as in a wheel install;"
                     " a source checkout has it)"]
    assert "## text sample" not in text
    assert "greedy outputs identical to stock HF: yes" in text


def test_named_shape_and_no_sample(timed, monkeypatch, capsys):
    monkeypatch.setattr(sample, "run", lambda *a, **k: pytest.fail("--no-sample ran the sample"))
    assert cli.main(["bench", "--device", "cpu", "--model", "tiny-llama", "--no-sample"]) == 0
    assert timed == [("tiny-llama", (32, 256))]
    text = capsys.readouterr().out
    assert "text sample" not in text and "greedy outputs identical to stock HF: yes" in text


def test_differing_text_fails_the_command(timed, monkeypatch, capsys):
    one = {"prompt": "x", "stock": "1 2", "llmplug": "1 3", "identical": False, "first_difference": 1}
    differs = {"model": sample.MODEL_NAME, "params": 8_392_960, "dtype": "torch.float32", "new_tokens": 2,
               "identical": False, "samples": [one]}
    monkeypatch.setattr(sample, "run", lambda *a, **k: differs)
    assert cli.main(["bench", "--device", "cpu"]) == 1
    text = capsys.readouterr().out
    assert "(DIFFERS from stock HF from new token 2 on)" in text and "greedy outputs identical to stock HF: NO" in text


@pytest.mark.parametrize("argv, threads", [([], 1), (["--threads", "2"], 2)])
def test_cpu_bench_threads(timed, monkeypatch, argv, threads):
    """On CPU the bench runs on one intra-op thread unless told otherwise, and gives the caller's setting back."""
    seen = []
    run = e2e.run
    monkeypatch.setattr(e2e, "run", lambda *a, **k: seen.append(torch.get_num_threads()) or run(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert cli.main(["bench", "--device", "cpu", "--no-sample", *argv]) == 0
        assert seen == [threads] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["bench", "--dtype", "fp64"]])
def test_help_and_usage_errors_load_nothing_heavy(argv):
    """The console script's module parses before torch, transformers or llmplug load (``import llmplug`` takes
    seconds: it registers llmplug's quantizer with transformers)."""
    code = ("import sys, llmplug_cli\ntry:\n    llmplug_cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('exit', e.code)\nprint('loaded', [m for m in ('torch', 'transformers', 'llmplug') if m in "
            "sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert "loaded []" in out, out
    if argv[-1] == "--help":
        assert "exit 0" in out and "usage: llmplug" in out
        assert argv == ["--help"] or f"models/{sample.MODEL_NAME}" in out
    else:
        assert "exit 2" in out and "invalid choice: 'fp64'" in out


def test_console_script_is_the_light_module():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {"llmplug": "llmplug_cli:main"}
    assert "llmplug_cli" in project["tool"]["setuptools"]["py-modules"]


def test_throughput_options_reach_the_full_parser(capsys):
    import llmplug_cli

    with pytest.raises(SystemExit) as exit_:
        llmplug_cli.main(["bench", "throughput", "--help"])
    assert exit_.value.code == 0 and "--workloads" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        llmplug_cli.main(["bench", "throughput", "--workloads", "z"])
    assert "invalid choice: 'z'" in capsys.readouterr().err


def test_bench_speculative_on_cpu(tmp_path, capsys):
    """``llmplug bench speculative``: plain, prompt lookup, the trained draft model and the trained EAGLE-3 head on
    input-grounded prompts in ``generate``, then the Engine's plain, prompt-lookup and draft-model rows; every
    speculative output identical to plain decoding in fp32."""
    out = tmp_path / "spec.json"
    assert cli.main(["bench", "--new-tokens", "6", "--out", str(out), "speculative", "--batches", "1", "2",
                     "--prompts", "2"]) == 0
    text = capsys.readouterr().out
    assert "| llmplug-stdlib-small | 2 | llmplug-stdlib-draft |" in text
    assert "| llmplug-stdlib-small | 2 | llmplug-stdlib-small-eagle3 |" in text
    assert "speculative outputs identical to plain decoding: yes" in text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["proposer"]) for r in rows] == [(b, p) for b in (1, 2) for p in
                                                           ("none", "prompt lookup", "llmplug-stdlib-draft",
                                                            "llmplug-stdlib-small-eagle3")] + \
        [(b, p) for b in (1, 2) for p in ("none", "prompt lookup", "llmplug-stdlib-draft")]  # the Engine's
    assert "| llmplug-stdlib-small (Engine) | 2 | llmplug-stdlib-draft |" in text


def test_bench_tp_launches_torchrun_on_cpu(tmp_path):
    """``llmplug bench tp --tp 2`` relaunches itself under torchrun (two gloo processes): tiny-llama split over both
    ranks gives one process's tokens; rank 0 writes the report."""
    out = tmp_path / "tp.json"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "llmplug.cli", "bench", "--new-tokens", "8", "--out", str(out), "tp",
                           "--tp", "2", "--batches", "1", "3"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "split greedy outputs identical to one process: yes" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tp"], r["batch"]) for r in rows] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(r["identical"] for r in rows if r["tp"] == 2)


def test_bench_tp_agreement_on_cpu(tmp_path):
    """``--agreement``: on gloo in fp32 the split trained model continues every prompt as one process does, both
    batched and one at a time (interval reported, no margins to report)."""
    out = tmp_path / "tp.json"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "llmplug.cli", "bench", "--new-tokens", "4", "--out", str(out), "tp",
                           "--tp", "2", "--batches", "1", "--agreement", "models/llmplug-stdlib-small", "--prompts",
                           "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["agreement"]
    assert result["prompts"] == 3 and result["batched"] == result["one_at_a_time"] == 1.0
    assert result["batched_margins_at_divergence"] == result["one_at_a_time_margins_at_divergence"] == []
    assert result["one_at_a_time_interval"][1] == 1.0 and 0.3 < result["one_at_a_time_interval"][0] < 0.5


def test_wilson_interval():
    from llmplug.bench.tp import wilson_interval

    assert wilson_interval(93, 109) == [0.775, 0.908]  # last session's 85.3%: 90% is inside the interval
    assert wilson_interval(0, 10)[0] == 0.0


def test_bench_tp_sweeps_the_one_shot_program_cap(monkeypatch):
    """``bench tp`` times the one-shot all-reduce at every program cap its signal pads allow (here up to 64) for the
    batch-8 and batch-32 messages, then restores the cap; without symmetric memory it reports nothing."""
    from types import SimpleNamespace

    from llmplug.bench import tp

    one_shot = SimpleNamespace(programs=32, max_programs=64)
    group = SimpleNamespace(one_shot=one_shot, all_reduce=None)
    seen = []
    monkeypatch.setattr(tp, "allreduce_us", lambda reduce, numel, dtype: seen.append(one_shot.programs) or 1.0)
    out = tp.one_shot_programs(group)
    assert set(out) == {65536, 262144, 524288}
    assert all(list(v) == [16, 32, 64] for v in out.values()) and seen == [16, 32, 64] * 3
    assert one_shot.programs == 32
    assert tp.one_shot_programs(SimpleNamespace(one_shot=None)) == {}
