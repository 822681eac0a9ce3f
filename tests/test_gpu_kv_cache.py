"""GPU-only checks of the fp8/int8 KV cache (run on the device machine with TRITON_INTERPRET=0): the compiled store and
attention kernels against their references at real sizes, under ``torch.compile``, and end to end with CUDA graphs."""

import copy

import pytest
import torch
import transformers as tf

import llmplug
from llmplug.ops.decode_attention import decode_attention, decode_attention_ref
from llmplug.ops.kv_quant import QMAX, dequantize_ref, quantize_ref
from llmplug.ops.kv_store import store_kv, store_kv_ref
from llmplug.ops.prefill_attention import prefill_attention, prefill_attention_ref
from llmplug.ops.rope_store_kv import rope_store_kv, rope_store_kv_ref
from llmplug.state import state_of
from tests.engine.test_kv_cache_dtype import LOGITS_SQNR_DB, _teacher_forced_sqnr
from tests.ops.test_kv_quant import bits, quantize_pages
from tests.ops.test_rope_store_kv import _views
from tests.tiny_models import make_model, pad, prompts
from tests.tolerances import assert_close_elementwise, assert_close_matmul_like

pytestmark = pytest.mark.gpu
KV = [torch.float8_e4m3fn, torch.int8]


def _caches(num_blocks, page, hkv, d, kv_dtype):
    """Zeroed ``[k_cache, v_cache, k_scale, v_scale]`` on CUDA."""
    pages = [torch.zeros(num_blocks, page, hkv, d, dtype=kv_dtype, device="cuda") for _ in range(2)]
    return pages + [torch.zeros(num_blocks, hkv, page, device="cuda") for _ in range(2)]


@pytest.mark.parametrize("kv_dtype", KV)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_bit_exact(kv_dtype, dtype):
    t, hkv, d, page, blocks = 300, 8, 128, 16, 40
    k = (torch.randn(t, hkv, d, device="cuda") * torch.logspace(-3, 2, t, device="cuda")[:, None, None]).to(dtype)
    v = torch.randn(t, hkv, d, device="cuda").to(dtype)
    slots = torch.randperm(blocks * page, device="cuda")[:t]
    slots[::7] = -1
    caches, ref = _caches(blocks, page, hkv, d, kv_dtype), _caches(blocks, page, hkv, d, kv_dtype)
    store_kv(k, v, *caches[:2], slots, *caches[2:])
    store_kv_ref(k, v, *ref[:2], slots, *ref[2:])
    for got, want in zip(caches, ref, strict=True):
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("kv_dtype", KV)
def test_rope_store_kv_close_to_reference(kv_dtype):
    """The fused kernel's fp32 RoPE may round a k element to the neighbouring bf16 value (FMA): then that row's
    quantized values may differ by one step; nearly all match bit for bit."""
    t, h, hkv, d, page, blocks = 300, 32, 8, 128, 16, 40
    qkv = torch.randn(t, (h + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(t, device="cuda", dtype=torch.float32)[:, None]
    freqs = pos * 10000.0 ** (-torch.arange(0, d, 2, device="cuda") / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    slots = torch.randperm(blocks * page, device="cuda")[:t]

    caches, ref, qkv_ref = _caches(blocks, page, hkv, d, kv_dtype), _caches(blocks, page, hkv, d, kv_dtype), qkv.clone()
    rope_store_kv(*_views(qkv, h, hkv, d), cos, sin, *caches[:2], slots, *caches[2:])
    rope_store_kv_ref(*_views(qkv_ref, h, hkv, d), cos, sin, *ref[:2], slots, *ref[2:])
    assert_close_elementwise(qkv, qkv_ref)
    step = 1.0 if kv_dtype == torch.int8 else 32.0  # largest gap between neighbouring values, in scale units
    for pages, scale, pages_ref, scale_ref in ((caches[0], caches[2], ref[0], ref[2]),
                                               (caches[1], caches[3], ref[1], ref[3])):
        assert (bits(pages) == bits(pages_ref)).float().mean() > 0.99
        torch.testing.assert_close(scale, scale_ref, rtol=2**-7, atol=0)
        got = dequantize_ref(pages, scale.transpose(1, 2), torch.float32)
        want = dequantize_ref(pages_ref, scale_ref.transpose(1, 2), torch.float32)
        assert ((got - want).abs() <= 2 * step * scale.transpose(1, 2)[..., None]).all()  # a step, and the scale's ulp


def _paged(b, ctx, hkv, d, page, dtype, kv_dtype):
    blocks = b * (-(-ctx // page)) + 3
    k_cache = torch.randn(blocks, page, hkv, d, dtype=dtype, device="cuda")
    (kq, ks), (vq, vs) = quantize_pages(k_cache, kv_dtype), quantize_pages(torch.randn_like(k_cache), kv_dtype)
    bt = torch.randperm(blocks, device="cuda")[: b * (-(-ctx // page))].view(b, -1).to(torch.int32)
    return kq, vq, bt, {"k_scale": ks, "v_scale": vs}


CONFIGS = [(128, 32, 8, -1, 0.0), (64, 16, 16, 100, 0.0), (256, 8, 4, 300, 50.0), (80, 12, 4, -1, 0.0)]


@pytest.mark.parametrize("kv_dtype", KV)
@pytest.mark.parametrize("d,h,hkv,window,softcap", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_decode_attention_cuda(d, h, hkv, window, softcap, dtype, kv_dtype):
    b, page = 5, 16
    lens = torch.tensor([1, 77, 1000, 513, 2049], dtype=torch.int32, device="cuda")
    kq, vq, bt, scales = _paged(b, 2049, hkv, d, page, dtype, kv_dtype)
    q = torch.randn(b, h, d, dtype=dtype, device="cuda")
    args = (bt, lens, d**-0.5, window, softcap)
    out = decode_attention(q, kq, vq, *args, **scales)
    ref64 = decode_attention_ref(q.double(), kq, vq, *args, **scales)
    assert_close_matmul_like(out, ref64, decode_attention_ref(q, kq, vq, *args, **scales))


@pytest.mark.parametrize("kv_dtype", KV)
@pytest.mark.parametrize("d,h,hkv,window,softcap", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_prefill_attention_cuda(d, h, hkv, window, softcap, dtype, kv_dtype):
    new, ctx, page = [1, 300, 77, 1024], [0, 45, 700, 19], 16
    kq, vq, bt, scales = _paged(len(new), max(c + n for c, n in zip(ctx, new)), hkv, d, page, dtype, kv_dtype)
    t = sum(new)
    q = torch.randn(t, h, d, dtype=dtype, device="cuda")
    k, v = torch.randn(t, hkv, d, dtype=dtype, device="cuda"), torch.randn(t, hkv, d, dtype=dtype, device="cuda")
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    args = (bt, cu, torch.tensor(ctx, dtype=torch.int32, device="cuda"), max(new), d**-0.5, window, softcap)
    out = prefill_attention(q, k, v, kq, vq, *args, **scales)
    ref64 = prefill_attention_ref(q.double(), k.double(), v.double(), kq, vq, *args, **scales)
    assert_close_matmul_like(out, ref64, prefill_attention_ref(q, k, v, kq, vq, *args, **scales))


@pytest.mark.parametrize("kv_dtype", KV)
def test_quantized_store_and_decode_compile(kv_dtype):
    """``torch.compile`` traces into the Triton ops with the optional (mutated) scale tensors."""
    b, h, hkv, d, page = 4, 8, 2, 128, 16
    caches = _caches(16, page, hkv, d, kv_dtype)
    bt = torch.arange(16, device="cuda", dtype=torch.int32).view(b, -1)
    lens = torch.tensor([1, 20, 64, 33], dtype=torch.int32, device="cuda")
    slots = (bt[:, 0].long() * page + lens.long() - 1)
    q, k, v = (torch.randn(b, n, d, device="cuda", dtype=torch.bfloat16) for n in (h, hkv, hkv))

    def step(q, k, v, k_cache, v_cache, k_scale, v_scale):
        store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        return decode_attention(q, k_cache, v_cache, bt, lens, d**-0.5, k_scale=k_scale, v_scale=v_scale) * 2

    eager_caches = [c.clone() for c in caches]
    want = step(q, k, v, *eager_caches)
    got = torch.compile(step, fullgraph=True)(q, k, v, *caches)
    torch.testing.assert_close(got, want)
    for a, b_ in zip(caches, eager_caches, strict=True):
        assert torch.equal(bits(a), bits(b_))


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_generate_with_cuda_graphs_and_engine(kv):
    stock = make_model("llama").cuda()
    ids, mask = (x.cuda() for x in pad(prompts(5, lengths=(5, 13, 2, 8, 30))))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    expected = stock.generate(**kw)
    model = copy.deepcopy(stock)
    llmplug.optimize(model, kv_cache_dtype=kv, graph_batch_sizes=(1, 2, 8))
    out = model.generate(**kw, output_scores=True, return_dict_in_generate=True)
    assert state_of(model).runner._graphs, "decode did not go through a CUDA graph"
    assert state_of(model).runner.cache.k.element_size() == 1
    assert torch.equal(out.sequences[:, ids.shape[1]], expected[:, ids.shape[1]])
    assert _teacher_forced_sqnr(stock, out, ids, mask) >= LOGITS_SQNR_DB[kv]
    fast = copy.deepcopy(stock)
    llmplug.optimize(fast, kv_num_blocks=24, kv_block_size=8, kv_cache_dtype=kv)
    engine = llmplug.Engine(fast, llmplug.EngineConfig(max_num_batched_tokens=32, preemption_mode="swap",
                                                       swap_space_gb=0.001))
    engine.warmup()
    rows = prompts(8, lengths=(5, 30, 3, 12, 40, 2, 9, 21))
    outs = engine.generate(rows, llmplug.SamplingParams(max_new_tokens=24, do_sample=False, ignore_eos=True),
                           progress=False)
    assert engine.scheduler.num_preemptions > 0 and engine.blocks.num_used == 0
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_same_memory_holds_about_twice_the_tokens_cuda(kv):
    """``kv_memory_fraction`` sizing on the device (bf16 model, head dim 128): ~1.94x the bf16 pool's blocks."""
    config = tf.LlamaConfig(vocab_size=128, hidden_size=1024, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=256)
    blocks = {}
    for dtype in ("auto", kv):
        model = tf.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
        llmplug.optimize(model, kv_cache_dtype=dtype, kv_memory_fraction=0.1)
        blocks[dtype] = state_of(model).runner.ensure_cache().num_blocks
        llmplug.unoptimize(model)
        del model
        torch.cuda.empty_cache()
    assert 1.85 <= blocks[kv] / blocks["auto"] < 2.0, blocks


def test_quantize_ref_on_cuda_matches_cpu():
    x = torch.randn(64, 8, 128) * torch.logspace(-4, 2, 64)[:, None, None]
    for kv_dtype in KV:
        q_cpu, s_cpu = quantize_ref(x, kv_dtype)
        q_gpu, s_gpu = quantize_ref(x.cuda(), kv_dtype)
        assert torch.equal(bits(q_gpu.cpu()), bits(q_cpu)) and torch.equal(s_gpu.cpu(), s_cpu)
        assert q_cpu.float().abs().max() <= QMAX[kv_dtype]
