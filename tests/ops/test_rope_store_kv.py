import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from llmplug.ops.rope_store_kv import apply_rope_ref, rope_store_kv, rope_store_kv_ref
from tests.ops.test_kv_quant import KV_DTYPES, bits, quantize_pages
from tests.tolerances import assert_close_elementwise

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _fused_qkv(t, h, hkv, d, dtype):
    """A fused ``(T, (H + 2 Hkv) D)`` projection output and its q, k, v views."""
    qkv = torch.randn(t, (h + 2 * hkv) * d, dtype=dtype)
    return qkv, *_views(qkv, h, hkv, d)


def _views(qkv, h, hkv, d):
    t = qkv.shape[0]
    return (qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + hkv) * d].view(t, hkv, d),
            qkv[:, (h + hkv) * d :].view(t, hkv, d))


def _cos_sin(t, r, dtype=torch.float32):
    # Random rows, so the two halves differ (real tables repeat them; the op must not rely on it).
    return torch.randn(t, r).to(dtype), torch.randn(t, r).to(dtype)


def _cache(t, hkv, d, dtype, p=4):
    """Random ``(k_cache, v_cache)`` pages and a shuffled slot per token, the first one skipped (-1)."""
    blocks = -(-t // p) + 2
    cache = torch.randn(2, blocks, p, hkv, d, dtype=dtype)
    slots = torch.randperm(blocks * p)[:t]
    slots[0] = -1
    return cache, slots


def _check_fused(t, h, hkv, d, r, dtype, cos_dtype=torch.float32):
    qkv, q, k, v = _fused_qkv(t, h, hkv, d, dtype)
    cos, sin = _cos_sin(t, r, cos_dtype)
    cache, slots = _cache(t, hkv, d, dtype)
    qkv_ref, cache_ref = qkv.clone(), cache.clone()
    rope_store_kv_ref(*_views(qkv_ref, h, hkv, d), cos, sin, cache_ref[0], cache_ref[1], slots)
    rope_store_kv(q, k, v, cos, sin, cache[0], cache[1], slots)
    # The whole fused tensor: every q/k element rotated (or passed through beyond R), v untouched; and the
    # whole cache: stored slots hold the rotated k and v, every other slot (the skipped token's too) unchanged.
    assert_close_elementwise(qkv, qkv_ref)
    assert torch.equal(qkv[:, (h + hkv) * d :], qkv_ref[:, (h + hkv) * d :])
    assert_close_elementwise(cache, cache_ref)


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
    _check_fused(5, 8, 2, 64, 64, dtype, cos_dtype=dtype)


def test_separate_tensors_with_arbitrary_strides():
    q = torch.randn(4, 7, 64).transpose(0, 1)  # (T=7, H=4, D): stride(1) > stride(0)
    k = torch.randn(7, 2, 96)[:, :, :64]  # head stride 96, not D
    v = torch.randn(2, 7, 64).transpose(0, 1)
    cos, sin = _cos_sin(7, 48)
    cache, slots = _cache(7, 2, 64, torch.float32)
    q_ref, k_ref, cache_ref = q.clone(), k.clone(), cache.clone()
    rope_store_kv_ref(q_ref, k_ref, v, cos, sin, cache_ref[0], cache_ref[1], slots)
    rope_store_kv(q, k, v, cos, sin, cache[0], cache[1], slots)
    assert_close_elementwise(q, q_ref)
    assert_close_elementwise(k, k_ref)
    assert_close_elementwise(cache, cache_ref)


def _hf(q, k, cos, sin):
    """HF's ``apply_rotary_pos_emb`` on our ``(T, H, D)`` layout: it takes ``(B, H, T, D)`` and ``(B, T, R)``."""
    qe, ke = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    return qe[0].transpose(0, 1), ke[0].transpose(0, 1)


def test_reference_matches_hf():
    q, k = torch.randn(6, 8, 64), torch.randn(6, 2, 64)
    cos, sin = _cos_sin(6, 64)
    for got, want in zip(apply_rope_ref(q, k, cos, sin), _hf(q, k, cos, sin), strict=True):
        assert torch.allclose(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounds_where_hf_rounds(dtype):
    """In 16-bit dtypes the reference and the kernel give HF's values bit for bit (each product rounded, then the
    sum), not the closer fp32-then-round value."""
    q, k = (torch.randn(5, h, 64).to(dtype) for h in (4, 2))
    cos, sin = (t.to(dtype) for t in _cos_sin(5, 64))
    want = _hf(q, k, cos, sin)
    for got, hf in zip(apply_rope_ref(q, k, cos, sin), want, strict=True):
        assert torch.equal(got, hf)
    _, qk, kk, vk = _fused_qkv(5, 4, 2, 64, dtype)
    qk.copy_(q)
    kk.copy_(k)
    cache, slots = _cache(5, 2, 64, dtype)
    rope_store_kv(qk, kk, vk, cos, sin, *cache, slots)
    assert torch.equal(qk, want[0]) and torch.equal(kk, want[1])


def test_reference_matches_hf_partial_rotary():
    # Partial rotary as HF models do it: rotate the first R dims, pass the rest through.
    q, k = torch.randn(6, 8, 80), torch.randn(6, 2, 80)
    cos, sin = _cos_sin(6, 32)
    q_rot, k_rot = _hf(q[..., :32], k[..., :32], cos, sin)
    q_ref, k_ref = apply_rope_ref(q, k, cos, sin)
    assert torch.allclose(q_ref, torch.cat([q_rot, q[..., 32:]], -1))
    assert torch.allclose(k_ref, torch.cat([k_rot, k[..., 32:]], -1))


def test_bad_shapes():
    _, q, k, v = _fused_qkv(3, 4, 2, 64, torch.float32)
    cos, sin = _cos_sin(3, 64)
    cache, slots = _cache(3, 2, 64, torch.float32)
    call = lambda **kw: rope_store_kv(**{**dict(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=cache[0],  # noqa: E731
                                                v_cache=cache[1], slot_mapping=slots), **kw})
    with pytest.raises(ValueError, match="R=63"):
        call(cos=cos[:, :63], sin=sin[:, :63])
    with pytest.raises(ValueError, match="R=128"):
        call(cos=torch.randn(3, 128), sin=torch.randn(3, 128))
    with pytest.raises(ValueError, match=r"\(4, 64\)"):
        call(cos=torch.randn(4, 64), sin=torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"\(3, 2, 32\)"):
        call(k=torch.randn(3, 2, 32))
    with pytest.raises(ValueError, match="dtype"):
        call(q=q.half())
    with pytest.raises(ValueError, match="int64"):
        call(slot_mapping=slots.int())


@pytest.mark.interpreter  # on CPU the op is opaque only under the interpreter (llmplug_op)
def test_opcheck():
    _, q, k, v = _fused_qkv(5, 4, 2, 48, torch.float32)
    cos, sin = _cos_sin(5, 32)
    cache, slots = _cache(5, 2, 48, torch.float32)
    torch.library.opcheck(torch.ops.llmplug.rope_store_kv.default,
                          (q, k, v, cos, sin, cache[0].clone(), cache[1].clone(), slots))


@pytest.mark.interpreter  # on CPU the op is opaque only under the interpreter (llmplug_op)
def test_compiles():
    def step(qkv, cos, sin, k_cache, v_cache, slots):
        q, k, v = _views(qkv, 4, 2, 32)
        rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
        return qkv * 2

    fn = torch.compile(step, fullgraph=True)
    qkv = torch.randn(3, 256)
    cos, sin = _cos_sin(3, 32)
    cache, slots = _cache(3, 2, 32, torch.float32)
    qkv_ref, cache_ref = qkv.clone(), cache.clone()
    rope_store_kv_ref(*_views(qkv_ref, 4, 2, 32), cos, sin, cache_ref[0], cache_ref[1], slots)
    assert_close_elementwise(fn(qkv, cos, sin, cache[0], cache[1], slots), qkv_ref * 2)
    assert_close_elementwise(cache, cache_ref)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("tokens, heads, d, r, dtype", [
    (1, (4, 4), 64, 64, torch.bfloat16),
    (19, (8, 2), 128, 128, torch.float16),
    (19, (8, 1), 80, 32, torch.float32),
    (19, (4, 1), 128, 64, torch.bfloat16),
])
def test_quantized_cache_matches_reference(kv_dtype, tokens, heads, d, r, dtype):
    """fp8/int8 pages: q and k rotated as before; pages and scales as the reference stores them, bit for bit."""
    h, hkv = heads
    qkv, q, k, v = _fused_qkv(tokens, h, hkv, d, dtype)
    cos, sin = _cos_sin(tokens, r)
    cache, slots = _cache(tokens, hkv, d, dtype)
    pages = [quantize_pages(c, kv_dtype) for c in cache]
    caches = [pages[0][0], pages[1][0], pages[0][1], pages[1][1]]  # k, v, k_scale, v_scale
    qkv_ref, caches_ref = qkv.clone(), [c.clone() for c in caches]
    rope_store_kv_ref(*_views(qkv_ref, h, hkv, d), cos, sin, *caches_ref[:2], slots, *caches_ref[2:])
    rope_store_kv(q, k, v, cos, sin, *caches[:2], slots, *caches[2:])
    assert_close_elementwise(qkv, qkv_ref)
    for got, want in zip(caches, caches_ref, strict=True):
        assert torch.equal(bits(got), bits(want))
