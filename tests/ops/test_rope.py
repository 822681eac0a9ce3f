import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from llmplug.ops.rope import apply_rope_, apply_rope_ref
from tests.tolerances import assert_close_elementwise

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _fused_qkv(t, h, hkv, d, dtype):
    """A fused ``(T, (H + 2 Hkv) D)`` projection output and its q, k, v views."""
    qkv = torch.randn(t, (h + 2 * hkv) * d, dtype=dtype)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
    return qkv, q, k, v


def _cos_sin(t, r, dtype=torch.float32):
    # Random rows, so the two halves differ (real tables repeat them; the op must not rely on it).
    return torch.randn(t, r).to(dtype), torch.randn(t, r).to(dtype)


def _check_fused(t, h, hkv, d, r, dtype):
    qkv, q, k, v = _fused_qkv(t, h, hkv, d, dtype)
    cos, sin = _cos_sin(t, r)
    q_ref, k_ref = apply_rope_ref(q, k, cos, sin)
    expected = torch.cat([q_ref.reshape(t, -1), k_ref.reshape(t, -1), v.reshape(t, -1)], dim=1)
    apply_rope_(q, k, cos, sin)
    # The whole fused tensor: every q/k element rotated (or passed through beyond R), v untouched.
    assert_close_elementwise(qkv, expected)
    assert torch.equal(qkv[:, (h + hkv) * d :], expected[:, (h + hkv) * d :])


@pytest.mark.parametrize("tokens", [1, 19])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("d,r", [(64, 64), (80, 80), (128, 128), (256, 256), (128, 64), (80, 32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qkv_views_match_reference(tokens, heads, d, r, dtype):
    _check_fused(tokens, *heads, d, r, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_tokens(dtype):  # one shape only: the interpreter is slow at 99 tokens
    _check_fused(99, 8, 2, 128, 64, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cos_sin_in_model_dtype(dtype):
    _, q, k, _ = _fused_qkv(5, 8, 2, 64, dtype)
    cos, sin = _cos_sin(5, 64, dtype)
    q_ref, k_ref = apply_rope_ref(q, k, cos, sin)
    apply_rope_(q, k, cos, sin)
    assert_close_elementwise(q, q_ref)
    assert_close_elementwise(k, k_ref)


def test_separate_tensors_with_arbitrary_strides():
    q = torch.randn(4, 7, 64).transpose(0, 1)  # (T=7, H=4, D): stride(1) > stride(0)
    k = torch.randn(7, 2, 96)[:, :, :64]  # head stride 96, not D
    cos, sin = _cos_sin(7, 48)
    q_ref, k_ref = apply_rope_ref(q, k, cos, sin)
    apply_rope_(q, k, cos, sin)
    assert_close_elementwise(q, q_ref)
    assert_close_elementwise(k, k_ref)


def _hf(q, k, cos, sin):
    """HF's ``apply_rotary_pos_emb`` on our ``(T, H, D)`` layout: it takes ``(B, H, T, D)`` and ``(B, T, R)``."""
    qe, ke = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    return qe[0].transpose(0, 1), ke[0].transpose(0, 1)


def test_reference_matches_hf():
    q, k = torch.randn(6, 8, 64), torch.randn(6, 2, 64)
    cos, sin = _cos_sin(6, 64)
    for got, want in zip(apply_rope_ref(q, k, cos, sin), _hf(q, k, cos, sin), strict=True):
        assert torch.allclose(got, want)


def test_reference_matches_hf_partial_rotary():
    # Partial rotary as HF models do it: rotate the first R dims, pass the rest through.
    q, k = torch.randn(6, 8, 80), torch.randn(6, 2, 80)
    cos, sin = _cos_sin(6, 32)
    q_rot, k_rot = _hf(q[..., :32], k[..., :32], cos, sin)
    q_ref, k_ref = apply_rope_ref(q, k, cos, sin)
    assert torch.allclose(q_ref, torch.cat([q_rot, q[..., 32:]], -1))
    assert torch.allclose(k_ref, torch.cat([k_rot, k[..., 32:]], -1))


def test_bad_shapes():
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    cos, sin = _cos_sin(3, 64)
    with pytest.raises(ValueError, match="R=63"):
        apply_rope_(q, k, *_cos_sin(3, 63))
    with pytest.raises(ValueError, match="R=128"):
        apply_rope_(q, k, *_cos_sin(3, 128))
    with pytest.raises(ValueError, match=r"\(4, 64\)"):
        apply_rope_(q, k, *_cos_sin(4, 64))
    with pytest.raises(ValueError, match=r"\(3, 2, 32\)"):
        apply_rope_(q, torch.randn(3, 2, 32), cos, sin)
    with pytest.raises(ValueError, match="k.dtype"):
        apply_rope_(q, k.half(), cos, sin)


def test_opcheck():
    cos, sin = _cos_sin(5, 32)
    op = torch.ops.llmplug.apply_rope.default
    torch.library.opcheck(op, (torch.randn(5, 4, 32), torch.randn(5, 2, 32), cos, sin))
    _, q, k, _ = _fused_qkv(5, 4, 2, 48, torch.float32)
    torch.library.opcheck(op, (q, k, cos, sin))


def test_compiles():
    def attention_inputs(qkv, cos, sin):
        q, k = qkv[:, :128].view(3, 4, 32), qkv[:, 128:192].view(3, 2, 32)
        apply_rope_(q, k, cos, sin)
        return qkv * 2

    fn = torch.compile(attention_inputs, fullgraph=True)
    qkv = torch.randn(3, 256)
    cos, sin = _cos_sin(3, 32)
    q_ref, k_ref = apply_rope_ref(qkv[:, :128].view(3, 4, 32), qkv[:, 128:192].view(3, 2, 32), cos, sin)
    expected = torch.cat([q_ref.reshape(3, -1), k_ref.reshape(3, -1), qkv[:, 192:]], 1) * 2
    assert_close_elementwise(fn(qkv, cos, sin), expected)
