"""The one tolerance table (DESIGN.md section 3). Import from here; never hard-code tolerances in a test."""

import torch

# Elementwise ops and norms: max abs error relative to max |ref|.
ELEMENTWISE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def assert_close_elementwise(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Elementwise/norm ops: ``max|out - ref| <= tol * max(1, max|ref|)`` with the dtype's tolerance."""
    tol = ELEMENTWISE[out.dtype]
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite values in output"
    err = (out.double() - ref.double()).abs().max().item()
    scale = max(1.0, ref.double().abs().max().item())
    assert err <= tol * scale, f"max abs error {err:.3g} > {tol} * {scale:.3g} ({out.dtype})"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def assert_close_matmul_like(out: torch.Tensor, ref64: torch.Tensor, torch_same_dtype: torch.Tensor) -> None:
    """Attention/matmul ops: error vs an fp64 reference at most 2x PyTorch's own same-dtype error.

    A floor of 1e-6 relative error keeps fp32 comparisons from failing on PyTorch being exact by luck.
    """
    assert torch.isfinite(out).all(), "non-finite values in output"
    ours, theirs = rel_err(out, ref64), rel_err(torch_same_dtype, ref64)
    assert ours <= 2 * max(theirs, 1e-6), f"rel error {ours:.3g} > 2x torch's {theirs:.3g} ({out.dtype})"


# Quantized linears: SQNR (dB) of the output against the unquantized fp32 product (the bars), and of a
# kernel against its own reference (same quantized weights; only rounding order differs).
QUANT_SQNR_DB = {"int8": 35.0, "int4": 18.0, "fp8": 25.0}
KERNEL_VS_REF_SQNR_DB = 40.0

# Attention over an fp8/int8 KV cache against the same attention over the unquantized cache: SQNR (dB) on random
# normal K/V. e4m3 keeps 3 mantissa bits (relative rounding error <= 2^-4, ~3% rms): measured 30.5-31.8 dB; int8 with
# a per-token absmax scale (error <= absmax / 254, ~0.6% rms of N(0, 1) rows): measured 43-44 dB.
KV_CACHE_SQNR_DB = {torch.float8_e4m3fn: 28.0, torch.int8: 40.0}
