"""The trained models in ``models/`` load as a newcomer loads them: a plain ``from_pretrained`` gives fp32 (the
weights are stored in bf16 and widen exactly), the dtype the CPU path is token-identical to stock HF in."""

import json
import struct

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmplug.bench.sample import default_model

SMALL = default_model()
MODELS = [] if SMALL is None else [SMALL, SMALL.parent / "llmplug-stdlib-draft"]


def _stored_dtypes(path) -> set[str]:
    with open(path / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


@pytest.mark.skipif(SMALL is None, reason="models/ is not in this checkout")
@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.name)
def test_plain_from_pretrained_is_fp32_of_the_stored_bf16(path):
    assert _stored_dtypes(path) == {"BF16"}
    model = AutoModelForCausalLM.from_pretrained(path)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for (name, p), q in zip(model.named_parameters(), bf16.parameters()):
        assert torch.equal(p, q.float()), name  # the stored values, widened
