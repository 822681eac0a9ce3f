"""``llmplug::rope_dense_decode_attention``: RoPE, the static cache's store at the step's position and the masked
decode attention in one kernel, against its reference (interpreted on the CPU, compiled on the GPU): the output, and
the caches written at the position only (its old key, NaN here, never read)."""

import pytest
import torch

from llmplug.ops._triton import INTERPRET
from llmplug.ops.rope_dense_decode_attention import rope_dense_decode_attention, rope_dense_decode_attention_ref
from tests.tolerances import assert_close_matmul_like


def _rope_rows(bsz, head_dim, device):
    pos = torch.randint(0, 500, (bsz, 1), device=device).float()
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    emb = torch.cat([pos * inv, pos * inv], dim=-1)  # HF's layout: the frequencies twice
    return emb.cos(), emb.sin()


def _inputs(bsz, num_heads, num_kv, head_dim, length, dtype, position, device="cpu", see_new=True):
    q = torch.randn(bsz, num_heads, head_dim, device=device).to(dtype)
    k, v = (torch.randn(bsz, num_kv, head_dim, device=device).to(dtype) for _ in range(2))
    k_cache, v_cache = (torch.randn(bsz, num_kv, length, head_dim, device=device).to(dtype) for _ in range(2))
    mask = torch.rand(bsz, length, device=device) < 0.7
    mask[:, 0] = True
    hidden = ~mask[:, None, :, None].expand_as(k_cache)
    k_cache, v_cache = k_cache.masked_fill(hidden, float("nan")), v_cache.masked_fill(hidden, float("nan"))
    if 0 <= position < length:
        mask[:, position] = see_new
        k_cache[:, :, position], v_cache[:, :, position] = float("nan"), float("nan")  # replaced before it is seen
    cos, sin = (t.to(dtype) for t in _rope_rows(bsz, head_dim, device))
    return q, k, v, cos, sin, k_cache, v_cache, torch.tensor([position], device=device), mask


def _check(args, scale=0.3):
    q, k, v, cos, sin, k_cache, v_cache, position, mask = args
    caches = [k_cache.clone(), v_cache.clone()]
    out = rope_dense_decode_attention(q, k, v, cos, sin, k_cache, v_cache, position, mask, scale)
    ref = rope_dense_decode_attention_ref(q, k, v, cos, sin, *caches, position, mask, scale)
    wide = [c.double() for c in caches]  # the caches as stored (in q's dtype), the attention in fp64
    ref64 = rope_dense_decode_attention_ref(q.double(), k.double(), v.double(), cos.double(), sin.double(), *wide,
                                            position, mask, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(k_cache, caches[0], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, caches[1], equal_nan=True, rtol=0, atol=0)
    assert_close_matmul_like(out, ref64, ref)


# name: (B, H, Hkv, D, L, dtype, position)
CASES = {"mha-fp32": (1, 4, 4, 64, 19, torch.float32, 7), "gqa4-bf16-last": (3, 8, 2, 128, 99, torch.bfloat16, 98),
         "mqa-d80-fp16-first": (2, 8, 1, 80, 77, torch.float16, 0), "gqa2-d32-bf16": (2, 4, 2, 32, 40, torch.bfloat16,
                                                                                   23)}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_reference(case):
    torch.manual_seed(0)
    _check(_inputs(*CASES[case]))


def test_a_hidden_new_key_is_stored_but_not_seen_and_a_position_outside_stores_nothing():
    torch.manual_seed(1)
    _check(_inputs(2, 4, 2, 64, 21, torch.float32, 9, see_new=False))
    args = _inputs(2, 4, 2, 64, 21, torch.float32, 21)
    before = args[5].clone()
    _check(args)
    torch.testing.assert_close(args[5], before, equal_nan=True)


def test_rope_rows_broadcast_over_the_batch_and_no_mask():
    torch.manual_seed(2)
    q, k, v, cos, sin, k_cache, v_cache, position, _ = _inputs(3, 4, 2, 64, 17, torch.float32, 5)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    _check((q, k, v, cos[:1], sin[:1], k_cache, v_cache, position, None))


def test_bad_inputs():
    q, k, v, cos, sin, k_cache, v_cache, position, mask = _inputs(2, 4, 2, 64, 17, torch.float32, 3)
    with pytest.raises(ValueError, match=r"k must be \(2, 2, 64\)"):
        rope_dense_decode_attention(q, k[:, :1], v, cos, sin, k_cache, v_cache, position, mask)
    with pytest.raises(ValueError, match=r"cos must be \(2, 64\)"):
        rope_dense_decode_attention(q, k, v, cos[:, :32], sin, k_cache, v_cache, position, mask)
    with pytest.raises(ValueError, match="position must be"):
        rope_dense_decode_attention(q, k, v, cos, sin, k_cache, v_cache, position.int(), mask)


def test_opcheck():
    q, k, v, cos, sin, k_cache, v_cache, position, mask = _inputs(2, 4, 2, 64, 17, torch.float32, 3)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    torch.library.opcheck(torch.ops.llmplug.rope_dense_decode_attention.default,
                          (q, k, v, cos, sin, k_cache, v_cache, position, mask, 0.125))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels only: run with TRITON_INTERPRET=0")
@pytest.mark.parametrize("length, position", [(384, 200), (1500, 1499)])
def test_gpu_matches_reference(length, position):
    torch.manual_seed(3)
    for bsz in (1, 4):
        _check(_inputs(bsz, 32, 8, 128, length, torch.bfloat16, position, device="cuda"))


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("see_new", [True, False])
def test_split_contexts_fold_the_new_key_once(splits, see_new):
    """Flash-decoding splits over a dense cache: the new key folded in by one split only, its slot left out of every
    split's tiles; 8 splits over 5 tiles leave 3 without a tile (a dense cache's split count rounds up)."""
    from llmplug.ops.decode_attention import launch_decode_attention

    torch.manual_seed(4)
    q, k, v, cos, sin, k_cache, v_cache, position, mask = _inputs(2, 4, 2, 32, 70, torch.float32, 40,
                                                                  see_new=see_new)
    caches = [k_cache.clone(), v_cache.clone()]
    out = launch_decode_attention(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), None, None, 0.3, -1, 0.0,
                                  splits, None, None, new_token=(k, v, cos, sin, position),
                                  key_mask=mask.view(torch.uint8))
    ref = rope_dense_decode_attention_ref(q, k, v, cos, sin, *caches, position, mask, 0.3)
    torch.testing.assert_close(k_cache, caches[0], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
