import pytest
import torch

from llmplug.ops.rope_store_kv import rope_store_kv, rope_store_kv_ref
from tests.tolerances import assert_close_elementwise


def _case(t, h, hkv, d, r, dtype, blocks=6, p=4):
    qkv = torch.randn(t, (h + 2 * hkv) * d, dtype=dtype)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
    cos, sin = torch.randn(t, r), torch.randn(t, r)  # random halves: any unwritten element shows
    cache = torch.randn(2, blocks, p, hkv, d, dtype=dtype)
    slots = torch.randperm(blocks * p)[:t]
    slots[0] = -1  # a skipped token
    return qkv, q, k, v, cos, sin, cache, slots


@pytest.mark.parametrize("t,h,hkv,d,r", [(1, 4, 4, 64, 64), (7, 8, 2, 80, 80), (5, 8, 1, 128, 64), (3, 4, 2, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_rope_then_store(t, h, hkv, d, r, dtype):
    qkv, q, k, v, cos, sin, cache, slots = _case(t, h, hkv, d, r, dtype)
    qkv_ref, cache_ref = qkv.clone(), cache.clone()
    ref = _case_views(qkv_ref, h, hkv, d)
    rope_store_kv_ref(*ref, cos, sin, cache_ref[0], cache_ref[1], slots)
    rope_store_kv(q, k, v, cos, sin, cache[0], cache[1], slots)
    assert_close_elementwise(qkv, qkv_ref)
    assert_close_elementwise(cache, cache_ref)
    assert torch.equal(qkv[:, (h + hkv) * d :], qkv_ref[:, (h + hkv) * d :])  # v itself untouched


def _case_views(qkv, h, hkv, d):
    t = qkv.shape[0]
    return (qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + hkv) * d].view(t, hkv, d),
            qkv[:, (h + hkv) * d :].view(t, hkv, d))


def test_bad_input():
    _, q, k, v, cos, sin, cache, slots = _case(3, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_store_kv(q, k, v, cos, sin, cache[0], cache[1], slots.int())
    with pytest.raises(ValueError, match="R even"):
        rope_store_kv(q, k, v, cos[:, :3], sin[:, :3], cache[0], cache[1], slots)


def test_opcheck():
    _, q, k, v, cos, sin, cache, slots = _case(3, 4, 2, 16, 16, torch.float32)
    torch.library.opcheck(torch.ops.llmplug.rope_store_kv.default,
                          (q.clone(), k.clone(), v, cos, sin, cache[0].clone(), cache[1].clone(), slots))
