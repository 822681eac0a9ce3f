"""scripts/train_small_models.py end to end on a tiny slice of the stdlib (CPU, a few seconds of training)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_small_models.py"
TINY = ["--device", "cpu", "--max-files", "30", "--steps", "3", "--draft-steps", "2", "--batch-size", "4",
        "--seq-len", "32", "--vocab-size", "320", "--sample-tokens", "4",
        "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
        "--draft-hidden", "16", "--draft-layers", "1", "--draft-heads", "1", "--draft-kv-heads", "1",
        "--draft-intermediate", "32"]


def _load_script():
    spec = importlib.util.spec_from_file_location("train_small_models", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def script():
    return _load_script()


@pytest.fixture(scope="module")
def trained(script, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("models")
        report = script.main(["--out", str(out), *TINY])
    finally:
        torch.set_num_threads(threads)
    return out, report


def test_files_and_report(script, trained):
    out, report = trained
    assert json.loads((out / "train_report.json").read_text()) == report
    for name in (script.SMALL_NAME, script.DRAFT_NAME):
        d = out / name
        files = {p.name for p in d.iterdir()}
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
        assert not any(f.endswith((".bin", ".pt", ".pth", ".pkl")) for f in files)
        m = report["models"][name]
        for key in ("params", "steps", "wall_time_s", "tokens_seen", "val_ppl", "val_ppl_train_precision", "samples"):
            assert key in m, key
        assert m["steps"] == (3 if name == script.SMALL_NAME else 2)
        assert m["tokens_seen"] == m["steps"] * 4 * 32
        assert np.isfinite(m["val_ppl"]) and m["val_ppl"] > 1
    for key in ("device", "versions", "data", "unigram_val_ppl", "total_wall_time_s", "total_size_bytes"):
        assert key in report, key
    assert report["data"]["val_files"] >= 1 and report["data"]["train_files"] + report["data"]["val_files"] <= 30
    assert report["total_size_bytes"] == sum(report["size_bytes"].values()) <= 25e6
    assert (out / ".cache" / ".gitignore").read_text().strip() == "*"


def test_from_pretrained_and_generate(script, trained):
    out, report = trained
    for name in (script.SMALL_NAME, script.DRAFT_NAME):
        d = out / name
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d)
        assert model.dtype == torch.float32  # stored in bf16, the config says fp32
        assert model.config.tie_word_embeddings and model.config.max_position_embeddings == 1024
        assert sum(p.numel() for p in model.parameters()) == report["models"][name]["params"]
        g = model.generation_config
        assert (g.bos_token_id, g.eos_token_id, g.pad_token_id) == (tok.bos_token_id, tok.eos_token_id,
                                                                     tok.pad_token_id)
        assert tok.convert_ids_to_tokens([g.bos_token_id, g.eos_token_id, g.pad_token_id]) == [
            "<|bos|>", "<|eos|>", "<|pad|>"]
        enc = tok(["def f(x):\n", "import os\n"], return_tensors="pt", padding=True)
        ids = model.generate(**enc, max_new_tokens=3, do_sample=False)
        assert ids.shape == (2, enc["input_ids"].shape[1] + 3)


def test_tokenizer_round_trip(script, trained):
    out, _ = trained
    tok = AutoTokenizer.from_pretrained(out / script.SMALL_NAME)
    text = 'def fibonacci(n):\n    """Return F(n)."""\n\tif n < 2:  # ünïcode ✓ 漢字\n        return n\n'
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_size_check(script, trained, tmp_path):
    out, _ = trained
    dirs = [out / script.SMALL_NAME, out / script.DRAFT_NAME]
    sizes = script.check_size(dirs, 25.0)
    assert sum(sizes.values()) == sum(script.dir_bytes(d) for d in dirs)
    with pytest.raises(RuntimeError, match="MB limit"):
        script.check_size(dirs, 0.01)
    with pytest.raises(RuntimeError, match="MB limit"):  # the whole run fails loudly too
        script.main(["--out", str(tmp_path), *TINY, "--steps", "1", "--draft-steps", "1", "--max-total-mb", "0.01"])


def test_split_and_unigram(script):
    files = [(f"m{i}.py", "x = 1\n") for i in range(500)]
    train, val = script.split_files(files)
    assert 1 <= len(val) <= 25 and len(train) + len(val) == 500
    assert script.split_files(files) == (train, val)
    train, val = script.split_files(files[:2])
    assert len(val) >= 1 and len(train) >= 1
    ids = np.array([0, 1, 1, 2, 2, 2])
    assert script.unigram_ppl(ids, ids, 3) == pytest.approx(
        np.exp(-np.mean(np.log(np.array([3, 3, 4, 4, 4]) / 9))))


def test_lr_schedule(script):
    lrs = [script.lr_at(s, s / 100, 1.0, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert script.lr_at(50, 1.0, 1.0, 10) == pytest.approx(0.1)
