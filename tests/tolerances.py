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
