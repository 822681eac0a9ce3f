"""Text sample: a few Python-code prompts through stock HF ``generate`` and llmplug, greedy, decoded side by side.

The model is ``models/llmplug-stdlib-small`` (8.4M parameters, a Llama trained on the Python standard library;
``models/README.md``), which lives in the source checkout next to the package: an editable install or a clone
finds it, a wheel does not (:func:`default_model` returns ``None`` there).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

import llmplug

from ..loading import load_causal_lm

MODEL_NAME = "llmplug-stdlib-small"
PROMPTS = ("def fibonacci(n):", "import os\n\n\nclass ", "def read_lines(path):\n    with open(")
NEW_TOKENS = 32
_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def default_model() -> Path | None:
    """The trained model's directory beside the package (``<checkout>/models/llmplug-stdlib-small``), or ``None``
    where it is not there (a wheel install)."""
    path = Path(__file__).resolve().parents[2] / "models" / MODEL_NAME
    return path if all((path / f).is_file() for f in _FILES) else None


def _rows(ids: torch.Tensor, eos: set[int]) -> list[list[int]]:
    """Generated ids ``(B, N)`` as lists, each cut after its first end-of-sequence token (the rest is padding)."""
    rows = []
    for row in ids.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (one ending early counts), ``None`` where equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(path: str | Path, device: str, dtype: torch.dtype, *, new_tokens: int = NEW_TOKENS,
        prompts: tuple[str, ...] = PROMPTS) -> dict:
    """Greedy continuations of ``prompts`` (one left-padded batch) from stock HF and from llmplug on the model in
    ``path``, decoded; ``identical`` says whether every token agreed, ``first_difference`` (per prompt) the index of
    the first new token that did not. The model is unoptimized again at the end."""
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = load_causal_lm(path, device, dtype=dtype)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    enc = tok(list(prompts), return_tensors="pt", padding=True).to(device)
    width = enc["input_ids"].shape[1]
    gen = dict(max_new_tokens=new_tokens, do_sample=False)
    stock = _rows(type(model).generate(model, **enc, **gen)[:, width:], eos)
    llmplug.optimize(model)
    try:
        ours = _rows(model.generate(**enc, **gen)[:, width:], eos)
    finally:
        llmplug.unoptimize(model)
    samples = [{"prompt": p, "stock": tok.decode(s, skip_special_tokens=True),
                "llmplug": tok.decode(o, skip_special_tokens=True), "identical": s == o,
                "first_difference": _first_difference(s, o)}
               for p, s, o in zip(prompts, stock, ours)]
    return {"model": Path(path).name, "params": sum(p.numel() for p in model.parameters()), "dtype": str(dtype),
            "new_tokens": new_tokens, "samples": samples, "identical": all(s["identical"] for s in samples)}
