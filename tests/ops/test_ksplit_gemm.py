"""K-sliced GEMMs whose fp32 partials the add + norm sums: the slices' layout, the rule, the fused forward through
them (CPU, references and interpreted kernels), and the CUDA kernels against the references."""

import pytest
import torch
import torch.nn.functional as F

import llmplug
from llmplug.ops import ksplit_gemm
from llmplug.ops._triton import cpu_kernels
from llmplug.ops.ksplit_gemm import ksplit_matmul, slices_for, splits
from llmplug.ops.rms_norm import parts_add_rms_norm, parts_add_rms_norm_ref, rms_norm_ref
from tests.tiny_models import make_model, pad, prompts
from tests.tolerances import assert_close_elementwise


@pytest.mark.parametrize("slices", [1, 2, 4])
def test_slices_sum_to_the_product(slices):
    x, w = torch.randn(19, 96), torch.randn(40, 96)
    parts = ksplit_matmul(x, w, slices)
    assert parts.shape == (slices, 19, 40) and parts.dtype == torch.float32
    for s in range(slices):
        cut = slice(s * 96 // slices, (s + 1) * 96 // slices)
        torch.testing.assert_close(parts[s], x[:, cut] @ w[:, cut].T)
    torch.testing.assert_close(parts.sum(0), F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="K=96 is not a multiple of slices=5"):
        ksplit_matmul(x, w, 5)


def test_rule():
    assert slices_for(128, 2048, 8192) == 4  # Llama-3.2-1B's down projection
    assert slices_for(128, 4096, 14336) == 0  # Llama-3-8B's: K = 3.5 N (its Engine was slower with two slices)
    assert slices_for(128, 2048, 2048) == 0  # o projection: K = N
    assert slices_for(8, 2048, 8192) == 0 and slices_for(257, 2048, 8192) == 0  # GEMV rows, prefill rows
    assert slices_for(64, 64, 264) == 0  # slices of 66 (132 bytes) would not be 16-byte aligned
    assert splits(torch.randn(128, 8192), torch.randn(2048, 8192)) == 0  # CPU, fp32


@pytest.mark.parametrize("rows", [1, 19])
@pytest.mark.parametrize("n", [64, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slices", [1, 2, 4])
def test_parts_add_rms_norm_matches_reference(rows, n, dtype, slices):
    parts, residual = torch.randn(slices, rows, n) * 2, (torch.randn(rows, n) * 4).to(dtype)
    w = (torch.randn(n) * 0.1 + 1.0).to(dtype)
    before = parts.clone(), residual.clone()
    out, residual_out = parts_add_rms_norm(parts, residual, w, 1e-6)
    _, want_residual = parts_add_rms_norm_ref(parts, residual, w, 1e-6)
    assert out.dtype == residual_out.dtype == dtype and out.shape == residual.shape
    assert_close_elementwise(residual_out, want_residual)
    assert_close_elementwise(out, rms_norm_ref(residual_out, w, 1e-6))  # the kernel's own rounded sum, normed
    assert torch.equal(parts, before[0]) and torch.equal(residual, before[1]), "inputs must not be modified"


def test_parts_reference_rounds_the_sum_once_then_adds():
    parts, residual = torch.randn(3, 4, 64), torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.ones(64)
    _, total = parts_add_rms_norm_ref(parts, residual, w, 1e-6)
    hidden = (parts[0] + parts[1] + parts[2]).to(torch.bfloat16)
    assert torch.equal(total, (hidden.float() + residual.float()).to(torch.bfloat16))


def test_parts_bad_input():
    w = torch.ones(64)
    with pytest.raises(ValueError, match=r"\(S, R, N\)"):
        parts_add_rms_norm(torch.randn(2, 3, 32), torch.randn(3, 64), w, 1e-6)
    with pytest.raises(ValueError, match="float32"):
        parts_add_rms_norm(torch.randn(2, 3, 64, dtype=torch.float16), torch.randn(3, 64), w, 1e-6)
    torch.library.opcheck(torch.ops.llmplug.parts_add_rms_norm.default,
                          (torch.randn(2, 5, 48), torch.randn(5, 48), torch.randn(48), 1e-6, 0.0, True))


@pytest.mark.parametrize("interpreted", [False, True])
def test_fused_forward_through_k_slices_matches_stock(monkeypatch, interpreted):
    """With every plain producer of an add + norm forced through two K slices (the rule would pick none for a tiny
    fp32 model on the CPU), greedy tokens stay stock HF's and the path ran."""
    model = make_model("llama")
    ids, mask = pad(prompts(3, lengths=(12, 9, 15)))
    gen = dict(max_new_tokens=6, do_sample=False)
    expected = model.generate(input_ids=ids, attention_mask=mask, **gen)
    llmplug.optimize(model)
    calls = []
    monkeypatch.setattr(ksplit_gemm, "splits", lambda x, w: calls.append(x.shape[0]) or 2)
    with cpu_kernels(interpreted):
        got = model.generate(input_ids=ids, attention_mask=mask, **gen)
    assert calls and max(calls) >= 9
    assert torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n,k", [(128, 2048, 8192), (37, 384, 1536), (256, 1024, 4096)])
def test_cuda_k_slices_and_their_add_norm(dtype, rows, n, k):
    torch.manual_seed(0)
    x, w = torch.randn(rows, k, device="cuda", dtype=dtype), torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    s = splits(x, w)
    assert s == slices_for(rows, n, k) > 0
    parts = ksplit_matmul(x, w, s)
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(parts.sum(0), want, rtol=1e-3, atol=1e-3)
    residual, nw = torch.randn(rows, n, device="cuda", dtype=dtype), torch.rand(n, device="cuda", dtype=dtype) + 0.5
    out, total = parts_add_rms_norm(parts, residual, nw, 1e-5)
    want_out, want_total = parts_add_rms_norm_ref(parts, residual, nw, 1e-5)
    assert torch.equal(total, want_total)
    assert_close_elementwise(out, want_out)
