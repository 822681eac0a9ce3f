"""``llmplug::dense_decode_attention``: the paged decode kernel over HF's static-cache layout with a key mask, against
its reference (interpreted on the CPU, compiled on the GPU) and the reference against torch's SDPA as HF calls it."""

import pytest
import torch
import torch.nn.functional as F

from llmplug.ops._triton import INTERPRET, cpu_kernels
from llmplug.ops.dense_decode_attention import dense_decode_attention, dense_decode_attention_ref
from tests.tolerances import assert_close_matmul_like


def _inputs(bsz, num_heads, num_kv_heads, head_dim, length, dtype, device="cpu", poison=True):
    """Random q and a static cache whose hidden keys (mask False) are NaN with ``poison``: reading one shows."""
    q = torch.randn(bsz, num_heads, head_dim, device=device).to(dtype)
    k = torch.randn(bsz, num_kv_heads, length, head_dim, device=device).to(dtype)
    v = torch.randn(bsz, num_kv_heads, length, head_dim, device=device).to(dtype)
    mask = torch.rand(bsz, length, device=device) < 0.7
    mask[:, 0] = True  # every row sees a key
    if poison:
        hidden = ~mask[:, None, :, None].expand_as(k)
        k, v = k.masked_fill(hidden, float("nan")), v.masked_fill(hidden, float("nan"))
    return q, k, v, mask


def _check(q, k, v, mask, scale=None):
    out = dense_decode_attention(q, k, v, mask, scale)
    s = q.shape[-1] ** -0.5 if scale is None else scale
    ref64 = dense_decode_attention_ref(q.double(), k.double(), v.double(), mask, s)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close_matmul_like(out, ref64, dense_decode_attention_ref(q, k, v, mask, s))


# name: (B, H, Hkv, D, L, dtype)
CASES = {"mha-fp32-b1": (1, 4, 4, 64, 19, torch.float32), "gqa4-bf16": (3, 8, 2, 128, 99, torch.bfloat16),
         "mqa8-d80-fp16": (2, 8, 1, 80, 77, torch.float16), "gqa2-d256-bf16": (1, 4, 2, 256, 40, torch.bfloat16)}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_reference(case):
    torch.manual_seed(0)
    _check(*_inputs(*CASES[case]))


def test_static_cache_views_broadcast_mask_and_no_mask():
    """k/v as HF's ``(B, Hkv, L, D)`` tensors seen through a transposed layout, a mask broadcast over the batch
    (stride 0), and no mask at all."""
    torch.manual_seed(1)
    q, k, v, mask = _inputs(2, 4, 2, 64, 33, torch.float32, poison=False)
    kt, vt = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not kt.is_contiguous()
    _check(q, kt, vt, mask[:1].expand(2, -1), 0.3)
    _check(q, k, v, None)


def test_reference_matches_sdpa_as_hf_calls_it():
    """The oracle, against torch SDPA over the GQA-expanded cache with HF's additive mask (fp64)."""
    torch.manual_seed(2)
    q, k, v, mask = _inputs(3, 8, 2, 32, 21, torch.float64, poison=False)
    rep = 4
    expand = lambda t: t[:, :, None].expand(-1, -1, rep, -1, -1).reshape(3, 8, 21, 32)  # noqa: E731  HF's repeat_kv
    bias = torch.where(mask, 0.0, float("-inf")).to(torch.float64)[:, None, None, :]
    sdpa = F.scaled_dot_product_attention(q[:, :, None], expand(k), expand(v), attn_mask=bias, scale=0.2)[:, :, 0]
    torch.testing.assert_close(dense_decode_attention_ref(q, k, v, mask, 0.2), sdpa)


def test_reference_path_and_bad_inputs():
    q, k, v, mask = _inputs(2, 4, 2, 64, 17, torch.float32, poison=False)
    with cpu_kernels(False):
        torch.testing.assert_close(dense_decode_attention(q, k, v, mask), dense_decode_attention_ref(q, k, v, mask,
                                                                                                    0.125))
    with pytest.raises(ValueError, match="multiple of Hkv=3"):
        dense_decode_attention(q, k.repeat(1, 3, 1, 1)[:, :3], v.repeat(1, 3, 1, 1)[:, :3], mask)
    with pytest.raises(ValueError, match="key_mask must be"):
        dense_decode_attention(q, k, v, mask.int())
    with pytest.raises(ValueError, match="one dtype"):
        dense_decode_attention(q, k.half(), v.half(), mask)


def test_opcheck():
    q, k, v, mask = _inputs(2, 4, 2, 64, 17, torch.float32, poison=False)
    torch.library.opcheck(torch.ops.llmplug.dense_decode_attention.default, (q, k, v, mask, 0.125))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels only: run with TRITON_INTERPRET=0")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("length", [384, 1500])
def test_gpu_matches_reference(d, length):
    """The compiled kernel with its GPU tiles and splits, HF's static-cache lengths."""
    torch.manual_seed(3)
    _check(*_inputs(1, 32, 8, d, length, torch.bfloat16, device="cuda"))
    _check(*_inputs(4, 32, 8, d, length, torch.bfloat16, device="cuda"))
