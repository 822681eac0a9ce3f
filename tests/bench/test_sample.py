"""The text sample of ``llmplug bench``: the trained model in ``models/`` is found, stock HF and llmplug write the
same text with it (fp32, greedy), the lines printed, and ``None`` where the model is not beside the package."""

import pytest
import torch

from llmplug.bench import report, sample
from tests.tiny_models import reference_kernels

FILES = ("config.json", "model.safetensors", "tokenizer.json")


@pytest.fixture(scope="module", autouse=True)
def _references():
    with reference_kernels():
        yield


def test_default_model_is_the_checkouts():
    path = sample.default_model()
    assert path is not None and path.name == sample.MODEL_NAME and path.parent.name == "models"
    assert (path.parent.parent / "llmplug" / "bench" / "sample.py").is_file()


def test_default_model_missing_beside_a_wheel(tmp_path, monkeypatch):
    """An install without ``models/`` next to the package (a wheel in site-packages) finds nothing; an incomplete
    directory does not count."""
    monkeypatch.setattr(sample, "__file__", str(tmp_path / "llmplug" / "bench" / "sample.py"))
    assert sample.default_model() is None
    model = tmp_path / "models" / sample.MODEL_NAME
    model.mkdir(parents=True)
    for name in FILES[:-1]:
        (model / name).write_text("{}")
    assert sample.default_model() is None
    (model / FILES[-1]).write_text("{}")
    assert sample.default_model() == model


def test_trained_model_same_text_as_stock():
    res = sample.run(sample.default_model(), "cpu", torch.float32, new_tokens=6)
    assert res["identical"] and res["model"] == sample.MODEL_NAME and res["params"] == 8_392_960
    assert [s["prompt"] for s in res["samples"]] == list(sample.PROMPTS)
    for s in res["samples"]:
        assert s["identical"] and s["first_difference"] is None and s["llmplug"] == s["stock"] and s["stock"].strip()
    assert res["samples"][0]["stock"].startswith("\n")  # 'def fibonacci(n):' goes on with its body
    lines = report.sample_lines(res)
    assert lines[0].startswith(f"## text sample: {sample.MODEL_NAME} (8.4M parameters), greedy, 6 new tokens")
    assert sum("(identical to stock HF)" in line for line in lines) == len(sample.PROMPTS)
    assert sample.PROMPTS[2] + res["samples"][2]["llmplug"] in lines


def test_rows_cut_after_eos():
    ids = torch.tensor([[5, 1, 2, 2], [5, 6, 7, 8]])
    assert sample._rows(ids, {1}) == [[5, 1], [5, 6, 7, 8]]
    assert sample._rows(ids, set()) == [[5, 1, 2, 2], [5, 6, 7, 8]]


def test_first_difference():
    assert sample._first_difference([4, 5], [4, 5]) is None
    assert sample._first_difference([4, 5, 6], [4, 7, 6]) == 1
    assert sample._first_difference([4, 1], [4, 1, 6]) == 2  # one stopped at end-of-sequence, the other went on


def test_lines_say_where_text_differs():
    res = {"model": "m", "params": 1.5e6, "dtype": "torch.float32", "new_tokens": 3, "identical": False,
           "samples": [{"prompt": "x = ", "stock": "1", "llmplug": "2", "identical": False, "first_difference": 0}]}
    assert report.sample_lines(res) == ["## text sample: m (1.5M parameters), greedy, 3 new tokens, torch.float32",
                                        "--- stock HF, prompt 'x = '", "x = 1",
                                        "--- llmplug, prompt 'x = ' (DIFFERS from stock HF from new token 1 on)",
                                        "x = 2"]
    res["dtype"] = "torch.bfloat16"
    assert "(differs from stock HF from new token 1 on)" in report.sample_lines(res)[3]
