"""The quantized KV format (``llmplug.ops.kv_quant``): quantize/dequantize references and scale validation."""

import pytest
import torch

from llmplug.ops.kv_quant import AMAX_FLOOR, QMAX, check_scales, dequantize_ref, quantize_ref, read_pages_ref

KV_DTYPES = [torch.float8_e4m3fn, torch.int8]


def quantize_pages(cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache: (num_blocks, P, Hkv, D)`` -> ``(pages (num_blocks, P, Hkv, D) dtype, scales (num_blocks, Hkv, P))``."""
    pages, scale = quantize_ref(cache, dtype)
    return pages, scale.transpose(1, 2).contiguous()


def bits(t: torch.Tensor) -> torch.Tensor:
    """1-byte tensors as uint8 (fp8 NaN != NaN and ``-0 == 0`` would hide differences), others unchanged."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_quantize_ref_semantics(dtype):
    x = torch.randn(19, 3, 64) * torch.logspace(-4, 2, 19)[:, None, None]
    x[0, 1] = 0.0  # an all-zero row
    q, scale = quantize_ref(x, dtype)
    qmax = QMAX[dtype]
    assert q.dtype == dtype and scale.dtype == torch.float32 and scale.shape == (19, 3)
    torch.testing.assert_close(scale, x.abs().amax(-1).clamp_min(AMAX_FLOOR) / qmax, rtol=0, atol=0)
    assert (q[0, 1].float() == 0).all() and scale[0, 1] > 0
    assert q.float().abs().max() <= qmax and (q.float().abs().amax(-1)[x.abs().amax(-1) > 0] == qmax).all()
    err = (dequantize_ref(q, scale, torch.float32) - x).abs()
    if dtype == torch.int8:  # rounding to nearest: at most half a step
        assert (err <= 0.5 * scale[..., None] * (1 + 1e-6)).all()
    else:  # e4m3: 3 mantissa bits -> relative error <= 2^-4 (normals), half of 2^-9 steps below 2^-6 (subnormals)
        assert (err <= torch.maximum(x.abs() * 2**-4, 2**-10 * scale[..., None]) * (1 + 1e-6)).all()


def test_int8_rounds_half_away_from_zero():
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -2.5, 0.49]])  # absmax 127: scale 1
    q, scale = quantize_ref(x, torch.int8)
    assert scale.item() == 1.0
    assert q.tolist() == [[127, 1, -1, 2, -3, 0]]


def test_read_pages_ref_gathers_and_dequantizes():
    cache = torch.randn(5, 4, 2, 8)
    pages, scale = quantize_pages(cache, torch.int8)
    blocks, offsets = torch.tensor([3, 0, 3]), torch.tensor([1, 2, 3])
    got = read_pages_ref(pages, scale, blocks, offsets, torch.float64)
    want = torch.stack([pages[b, o].double() * scale[b, :, o].double()[:, None] for b, o in zip(blocks, offsets)])
    torch.testing.assert_close(got, want)
    assert torch.equal(read_pages_ref(cache, None, blocks, offsets, torch.float64), cache[blocks, offsets])


def test_check_scales():
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.int8)
    scale = torch.zeros(4, 2, 16)
    check_scales(cache, cache, scale, scale)
    check_scales(cache.half(), cache.half(), None, None)
    with pytest.raises(ValueError, match="needs k_scale"):
        check_scales(cache, cache, None, scale)
    with pytest.raises(ValueError, match="only for fp8/int8"):
        check_scales(cache.half(), cache.half(), scale, scale)
    with pytest.raises(ValueError, match=r"\(4, 2, 16\)"):
        check_scales(cache, cache, scale, scale.transpose(1, 2).contiguous())
    with pytest.raises(ValueError, match="float32"):
        check_scales(cache, cache, scale, scale.half())
