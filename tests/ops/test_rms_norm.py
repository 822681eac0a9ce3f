import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from llmplug.ops.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from tests.tolerances import assert_close_elementwise

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def _weight(n: int, dtype: torch.dtype, offset: float) -> torch.Tensor:
    # Gemma-style weights sit around 0 (used as 1 + w), Llama-style around 1.
    return (torch.randn(n) * 0.1 + (1.0 - offset)).to(dtype)


@pytest.mark.parametrize("rows", [1, 19, 99])
@pytest.mark.parametrize("n", [64, 80, 128, 200, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_reference(rows, n, dtype, offset):
    x = torch.randn(rows, n, dtype=dtype) * 3
    w = _weight(n, dtype, offset)
    out = rms_norm(x, w, EPS, offset)
    assert out.is_contiguous()
    assert_close_elementwise(out, rms_norm_ref(x, w, EPS, offset))


@pytest.mark.parametrize("rows", [1, 19, 99])
@pytest.mark.parametrize("n", [64, 80, 200])  # the kernel is rms_norm's; fewer sizes keep the interpreter quick
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_add_rms_norm_matches_reference(rows, n, dtype, offset):
    x, residual = torch.randn(rows, n, dtype=dtype), torch.randn(rows, n, dtype=dtype) * 4
    x_before, residual_before = x.clone(), residual.clone()
    w = _weight(n, dtype, offset)
    out, residual_out = add_rms_norm(x, residual, w, EPS, offset)
    assert_close_elementwise(residual_out, add_rms_norm_ref(x, residual, w, EPS, offset)[1])
    # The rounded sum is what gets normalised. (Against the kernel's own sum: the interpreter rounds fp32 -> bf16
    # toward zero, so comparing with the reference's sum would stack two bf16 rounding errors.)
    assert_close_elementwise(out, rms_norm_ref(residual_out, w, EPS, offset))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not be modified"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("d", [80, 128])
def test_per_head_norm_on_fused_qkv_views(dtype, heads, d):
    t, (h, hkv) = 7, heads
    qkv = torch.randn(t, (h + 2 * hkv) * d, dtype=dtype)
    before = qkv.clone()
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    for x in (q, k):
        w = _weight(d, dtype, 0.0)
        out = rms_norm(x, w, EPS)
        assert out.shape == x.shape and out.is_contiguous()
        assert_close_elementwise(out, rms_norm_ref(x, w, EPS))
    assert torch.equal(qkv, before)


def test_3d_input_with_permuted_strides():
    x = torch.randn(5, 3, 64).transpose(0, 1)  # (3, 5, 64), stride(0) < stride(1)
    w = torch.randn(64)
    assert_close_elementwise(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_weight_with_half_input(dtype):
    x, w = torch.randn(9, 200, dtype=dtype), torch.randn(200)
    assert_close_elementwise(rms_norm(x, w, EPS, 1.0), rms_norm_ref(x, w, EPS, 1.0))
    out, residual_out = add_rms_norm(x, x, w, EPS)
    assert residual_out.dtype == dtype
    assert_close_elementwise(out, rms_norm_ref(residual_out, w, EPS))


@pytest.mark.parametrize("n", [4096, 8192, 16384])
def test_large_hidden_sizes(n):
    x, residual, w = torch.randn(2, n, dtype=torch.bfloat16), torch.randn(2, n, dtype=torch.bfloat16), torch.randn(n)
    out, residual_out = add_rms_norm(x, residual, w, EPS)
    assert_close_elementwise(residual_out, add_rms_norm_ref(x, residual, w, EPS)[1])
    assert_close_elementwise(out, rms_norm_ref(residual_out, w, EPS))


def test_references_match_hf_modules():
    x, residual = torch.randn(6, 96), torch.randn(6, 96)
    llama, gemma = LlamaRMSNorm(96, eps=1e-5), GemmaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        llama.weight.normal_()
        gemma.weight.normal_()
        assert torch.allclose(rms_norm_ref(x, llama.weight, 1e-5), llama(x))
        assert torch.allclose(rms_norm_ref(x, gemma.weight, 1e-5, offset=1.0), gemma(x))
        out, residual_out = add_rms_norm_ref(x, residual, llama.weight, 1e-5)
        assert torch.equal(residual_out, x + residual)
        assert torch.allclose(out, llama(x + residual))


def test_olmo2_order_in_bf16_is_hfs():
    """OLMo 2 multiplies the fp32 normalised value by its weight before the one cast (``round_first=False`` at offset
    0): reference and kernel equal HF's module bit for bit in bf16, where Llama's order would not."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    olmo = Olmo2RMSNorm(96, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        olmo.weight.copy_(torch.rand(96) + 0.5)
        x = torch.randn(6, 96).to(torch.bfloat16)
        expected = olmo(x)
        assert torch.equal(rms_norm_ref(x, olmo.weight, 1e-6, round_first=False), expected)
        assert not torch.equal(rms_norm_ref(x, olmo.weight, 1e-6), expected)
        torch.testing.assert_close(rms_norm(x, olmo.weight, 1e-6, round_first=False), expected, rtol=0, atol=0)


def test_add_reference_normalises_the_rounded_sum():
    x, residual, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64)
    out, residual_out = add_rms_norm_ref(x, residual, w, EPS)
    assert torch.equal(residual_out, x + residual)  # HF's bf16 residual stream
    assert torch.equal(out, rms_norm_ref(x + residual, w, EPS))


def test_empty_and_bad_shapes():
    w = torch.ones(64)
    assert rms_norm(torch.empty(0, 64), w, EPS).shape == (0, 64)
    assert add_rms_norm(torch.empty(0, 64), torch.empty(0, 64), w, EPS)[1].shape == (0, 64)
    with pytest.raises(ValueError, match="weight.shape"):
        rms_norm(torch.randn(3, 32), w, EPS)
    with pytest.raises(ValueError, match=r"\(2, 3, 4, 64\)"):
        rms_norm(torch.randn(2, 3, 4, 64), w, EPS)
    with pytest.raises(ValueError, match=r"\(3, 32\)"):
        add_rms_norm(torch.randn(3, 64), torch.randn(3, 32), w, EPS)
    with pytest.raises(ValueError, match="residual.dtype"):
        add_rms_norm(torch.randn(3, 64), torch.randn(3, 64, dtype=torch.float16), w, EPS)


def test_opcheck():
    qkv = torch.randn(5, 6 * 32)
    torch.library.opcheck(torch.ops.llmplug.rms_norm.default, (torch.randn(5, 48), torch.randn(48), EPS, 0.0, True))
    torch.library.opcheck(torch.ops.llmplug.rms_norm.default,
                          (qkv[:, :128].view(5, 4, 32), torch.randn(32), EPS, 1.0, False))
    args = (torch.randn(5, 48), torch.randn(5, 48), torch.randn(48), EPS, 1.0, False)
    torch.library.opcheck(torch.ops.llmplug.add_rms_norm.default, args)


def test_compiles():
    w, wq = torch.randn(64), torch.randn(16)

    def block(x, residual):
        out, residual = add_rms_norm(x, residual, w, EPS)
        return rms_norm(out.view(3, 4, 16), wq, EPS, 1.0), residual

    fn = torch.compile(block, fullgraph=True)
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    got, got_residual = fn(x, residual)
    ref_out, ref_residual = add_rms_norm_ref(x, residual, w, EPS)
    assert_close_elementwise(got_residual, ref_residual)
    assert_close_elementwise(got, rms_norm_ref(ref_out.view(3, 4, 16), wq, EPS, 1.0))
