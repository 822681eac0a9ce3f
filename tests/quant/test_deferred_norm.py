"""A decoder's residual add + RMSNorm split over two quantized GEMVs (under the Triton interpreter on CPU): the
producer adds the residual and leaves ``(norm_weight + offset) * s`` with partial sums of squares, the consumer
scales its product by the norm's rsqrt. Against add_rms_norm followed by the consumer's reference."""

import pytest
import torch

from llmplug.ops.act_mul import act_and_mul_ref
from llmplug.ops.rms_norm import add_rms_norm_ref
from llmplug.ops.w4_linear import w4_linear, w4_linear_add_norm, w4_linear_ref
from llmplug.ops.w8_linear import w8_linear, w8_linear_add_norm, w8_linear_ref
from llmplug.quant.formats import quantize_fp8, quantize_int4, quantize_int8, sqnr_db
from tests.tolerances import KERNEL_VS_REF_SQNR_DB

QUANTIZE = {"int8": quantize_int8, "fp8": quantize_fp8}


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("gated", ["", "silu"])
def test_w8_add_norm_then_rstd(method, dtype, offset, gated):
    hidden, k_in, n_out, eps = 72, 100, 38, 1e-5  # 100: the byte GEMV for int8 too (K % 4 == 0 -> words)
    q1, s1 = QUANTIZE[method](torch.randn(hidden, k_in))
    q2, s2 = QUANTIZE[method](torch.randn(n_out, hidden))
    b1, b2 = torch.randn(hidden, dtype=dtype), torch.randn(n_out, dtype=dtype)
    x, residual = torch.randn(1, k_in, dtype=dtype), torch.randn(1, hidden, dtype=dtype)
    norm_weight = torch.rand(hidden, dtype=dtype) + 0.5

    out, residual_out, parts = w8_linear_add_norm(x, q1, s1, b1, residual, norm_weight, offset)
    y1 = w8_linear(x, q1, s1, b1)  # the same GEMV with a plain epilogue: the same sums
    normed, want_residual = add_rms_norm_ref(y1, residual, norm_weight, eps, offset)
    assert out.shape == residual_out.shape == (1, hidden) and out.dtype == residual_out.dtype == dtype
    torch.testing.assert_close(residual_out, want_residual, rtol=0, atol=0)  # rounded as HF rounds: y, then the sum
    torch.testing.assert_close(parts.sum(), want_residual.float().pow(2).sum(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.float(), (want_residual.float() * (norm_weight.float() + offset)).to(dtype).float(),
                               rtol=0, atol=0)

    y2 = w8_linear(out, q2, s2, b2, gated=gated, rstd_parts=parts, eps=eps)
    hf_order = w8_linear_ref(normed, q2, s2, b2)  # the input rounded after the norm, as HF rounds it
    hf_order = act_and_mul_ref(hf_order, gated) if gated else hf_order
    assert y2.shape == hf_order.shape and y2.dtype == dtype
    # exact: the same residual stream, the norm and both products in fp64 (the weight is rounded before the
    # normalisation here, after it in HF: either order is as far from exact)
    s64 = want_residual.double()
    normed64 = s64 * torch.rsqrt(s64.pow(2).mean() + eps) * (norm_weight.double() + offset)
    exact = (normed64 @ (q2.double() * s2.double()[:, None]).t()) + b2.double()
    exact = act_and_mul_ref(exact, gated) if gated else exact
    assert sqnr_db(exact, y2) >= min(sqnr_db(exact, hf_order) - 3.0, KERNEL_VS_REF_SQNR_DB)
    assert sqnr_db(hf_order, y2) >= 30.0  # no stray factor or lost term (a 1% error gives 40 dB)


def test_rstd_parts_errors():
    q, s = quantize_int8(torch.randn(8, 16))
    x, parts = torch.randn(2, 16), torch.ones(3)
    with pytest.raises(ValueError, match="one token"):
        w8_linear(x, q, s, rstd_parts=parts)
    with pytest.raises(ValueError, match="1-D float32"):
        w8_linear(x[:1], q, s, rstd_parts=parts.double())
    with pytest.raises(ValueError, match="one token"):
        w8_linear_add_norm(x, q, s, None, torch.randn(1, 8), torch.randn(8))
    with pytest.raises(ValueError, match="residual"):
        w8_linear_add_norm(x[:1], q, s, None, torch.randn(1, 9), torch.randn(8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gated", ["", "silu"])
def test_w4_add_norm_then_rstd(dtype, gated):
    hidden, k_in, n_out, group, eps, offset = 64, 256, 38, 64, 1e-6, 0.0
    q1, s1, z1 = (t.to(dtype) if t.is_floating_point() else t for t in quantize_int4(torch.randn(hidden, k_in), group))
    q2, s2, z2 = (t.to(dtype) if t.is_floating_point() else t for t in quantize_int4(torch.randn(n_out, hidden), 32))
    b1 = torch.randn(hidden, dtype=dtype)
    x, residual = torch.randn(1, k_in, dtype=dtype), torch.randn(1, hidden, dtype=dtype)
    norm_weight = torch.rand(hidden, dtype=dtype) + 0.5

    out, residual_out, parts = w4_linear_add_norm(x, q1, s1, z1, group, b1, residual, norm_weight, offset)
    normed, want_residual = add_rms_norm_ref(w4_linear(x, q1, s1, z1, group, b1), residual, norm_weight, eps, offset)
    torch.testing.assert_close(residual_out, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(parts.sum(), want_residual.float().pow(2).sum(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.float(), (want_residual.float() * norm_weight.float()).to(dtype).float(), rtol=0,
                               atol=0)
    y2 = w4_linear(out, q2, s2, z2, 32, gated=gated, rstd_parts=parts, eps=eps)
    want = w4_linear_ref(normed, q2, s2, z2, 32)
    want = act_and_mul_ref(want, gated) if gated else want
    assert y2.shape == want.shape and sqnr_db(want, y2) >= 30.0


def test_rstd_parts_read_in_chunks():
    """More partial sums than the GEMV reads at once (a wide producer): every one counts."""
    from llmplug.ops._qmm import NORM_PARTS_BLOCK, deferred_rstd_ref

    q, s = quantize_int8(torch.randn(24, 64))
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    parts = torch.rand(NORM_PARTS_BLOCK + 300) * 0.1
    parts[-1] = 50.0  # the last chunk's sums matter
    y = w8_linear(x, q, s, rstd_parts=parts, eps=1e-5)
    want = w8_linear_ref(x, q, s, rstd=deferred_rstd_ref(parts, 64, 1e-5))
    assert sqnr_db(want, y) >= KERNEL_VS_REF_SQNR_DB


def test_opcheck_add_norm_ops():
    q, s = quantize_int8(torch.randn(16, 64))
    x, residual, nw = torch.randn(1, 64), torch.randn(1, 16), torch.randn(16)
    torch.library.opcheck(torch.ops.llmplug.w8_linear_add_norm, (x, q, s, None, residual, nw, 0.0, 4, 32, 4, 2))
    parts = torch.rand(4)
    torch.library.opcheck(torch.ops.llmplug.w8_linear, (x, q, s, None, "", 1, 4, 32, 4, 2, 1, parts, 1e-6))
    q4, s4, z4 = quantize_int4(torch.randn(16, 64), 32)
    torch.library.opcheck(torch.ops.llmplug.w4_linear_add_norm,
                          (x, q4, s4, z4, 32, None, residual, nw, 1.0, 8, 1, 4, 1))
    torch.library.opcheck(torch.ops.llmplug.w4_linear, (x, q4, s4, z4, 32, None, "", 1, 8, 1, 4, 1, 1, parts, 1e-6))
