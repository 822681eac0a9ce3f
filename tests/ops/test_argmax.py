import pytest
import torch

from llmplug.ops import argmax as amod
from llmplug.ops._triton import cpu_kernels


def _logits(rows: int, vocab: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    top = x.float().max() + 2
    if vocab > 40:
        x[0, [vocab - 1, 40, 3]] = top.to(dtype)  # a tie across blocks: the first index wins
    if rows > 1:
        x[1, vocab // 3] = float("nan")  # NaN counts as +inf
        x[1, vocab // 2] = float("inf")
    if rows > 2:
        x[2] = float("-inf")  # nothing finite: index 0, as torch.argmax
    return x.to(device)


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 37), (5, 5000), (33, 999)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, 16])
def test_kernel_matches_reference(rows, vocab, dtype, block, monkeypatch):
    logits = _logits(rows, vocab, dtype)
    if block is not None:  # many blocks a row, so the combine's tie-break is exercised
        monkeypatch.setattr(amod, "argmax_block", lambda v: block)
    with cpu_kernels(True):
        got = amod.argmax(logits)
    want = amod.argmax_ref(logits)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    finite = torch.isfinite(logits.float()).all(-1)
    assert torch.equal(want[finite], logits.float().argmax(-1)[finite])  # torch.argmax where no NaN / inf
    if rows > 1 and vocab > 2:
        assert want[1] == vocab // 3


def test_bad_logits_are_refused():
    with pytest.raises(ValueError, match="unit stride"):
        amod.argmax(torch.randn(4, 6).T)
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        amod.argmax(torch.randn(6))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_equals_torch(rows, dtype):
    logits = _logits(rows, 128256, dtype, "cuda")
    assert torch.equal(amod.argmax(logits), amod.argmax_ref(logits))
