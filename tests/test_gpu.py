"""GPU-only checks (run on the device machine with TRITON_INTERPRET=0): compiled kernels at real sizes, and every
family token-identical to stock HF in fp32 with CUDA graphs on."""

import pytest
import torch

import llmplug
from llmplug.ops.decode_attention import decode_attention, decode_attention_ref
from llmplug.ops.prefill_attention import prefill_attention, prefill_attention_ref
from llmplug.ops.rope_decode_attention import rope_decode_attention, rope_decode_attention_ref
from llmplug.ops.rope_store_kv import apply_rope_ref
from llmplug.state import state_of
from tests.ops.test_kv_quant import bits, quantize_pages
from tests.tiny_models import FUSED, GENERIC, make_model, pad, prompts
from tests.tolerances import assert_close_matmul_like

pytestmark = pytest.mark.gpu


def _paged(b, ctx, hkv, d, p, dtype):
    blocks = b * (-(-ctx // p)) + 3
    kc = torch.randn(blocks, p, hkv, d, dtype=dtype, device="cuda")
    vc = torch.randn_like(kc)
    bt = torch.randperm(blocks, device="cuda")[: b * (-(-ctx // p))].view(b, -1).to(torch.int32)
    return kc, vc, bt


@pytest.mark.parametrize("d,h,hkv,window,softcap", [(128, 32, 8, -1, 0.0), (64, 16, 16, 100, 0.0),
                                                     (256, 8, 4, 300, 50.0), (80, 12, 4, -1, 0.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_cuda(d, h, hkv, window, softcap, dtype):
    b, p = 5, 16
    lens = torch.tensor([1, 77, 1000, 513, 2049], dtype=torch.int32, device="cuda")
    kc, vc, bt = _paged(b, 2049, hkv, d, p, dtype)
    q = torch.randn(b, h, d, dtype=dtype, device="cuda")
    out = decode_attention(q, kc, vc, bt, lens, d**-0.5, window, softcap)
    ref64 = decode_attention_ref(q.double(), kc.double(), vc.double(), bt, lens, d**-0.5, window, softcap)
    same = decode_attention_ref(q, kc, vc, bt, lens, d**-0.5, window, softcap)
    assert_close_matmul_like(out, ref64, same)


@pytest.mark.parametrize("b", [32, 128])
def test_decode_attention_serving_batches_cuda(b):
    """The 1B shape at 256 and 1,024 (sequence, kv head) programs: where tile_config tiles GPUs apart."""
    torch.manual_seed(b)
    d, h, hkv, p = 64, 32, 8, 16
    lens = torch.randint(1, 1100, (b,), dtype=torch.int32, device="cuda")
    kc, vc, bt = _paged(b, 1100, hkv, d, p, torch.bfloat16)
    q = torch.randn(b, h, d, dtype=torch.bfloat16, device="cuda")
    out = decode_attention(q, kc, vc, bt, lens, d**-0.5)
    ref64 = decode_attention_ref(q.double(), kc.double(), vc.double(), bt, lens, d**-0.5)
    assert_close_matmul_like(out, ref64, decode_attention_ref(q, kc, vc, bt, lens, d**-0.5))


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("d,h,hkv,window,softcap,rotary", [(128, 32, 8, -1, 0.0, 128), (64, 16, 16, 100, 0.0, 64),
                                                            (256, 8, 4, 300, 50.0, 128), (80, 12, 4, -1, 0.0, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("splits", [0, 1], ids=["auto-splits", "one-split"])
def test_rope_decode_attention_cuda(d, h, hkv, window, softcap, rotary, dtype, kv_dtype, splits):
    """The fused decode step (RoPE, store, attention; the last split combining where counters are given) against
    RoPE + store then attention, at real sizes: the output within the attention tolerance, the stored rows bit for bit
    (unquantized: RoPE rounded as HF rounds). One split: the whole context in one program."""
    b, p = 5, 16
    lens = torch.tensor([1, 77, 1000, 513, 2049], dtype=torch.int32, device="cuda")
    kc, vc, bt = _paged(b, 2049, hkv, d, p, dtype)
    caches = [kc, vc]
    if kv_dtype is not None:
        (kq, ks), (vq, vs) = quantize_pages(kc, kv_dtype), quantize_pages(vc, kv_dtype)
        caches = [kq, vq, ks, vs]
    pos = (lens - 1).long()
    slots = bt.gather(1, (pos // p)[:, None])[:, 0].long() * p + pos % p
    qkv = torch.randn(b, (h + 2 * hkv) * d, dtype=dtype, device="cuda")
    q, k, v = qkv[:, :h * d].view(b, h, d), qkv[:, h * d:(h + hkv) * d].view(b, hkv, d), qkv[:, (h + hkv) * d:].view(
        b, hkv, d)
    cos, sin = (torch.randn(b, rotary, dtype=dtype, device="cuda") for _ in range(2))
    ref_caches = [c.clone() for c in caches]
    scales = dict(k_scale=caches[2], v_scale=caches[3]) if kv_dtype is not None else {}
    ref_scales = dict(k_scale=ref_caches[2], v_scale=ref_caches[3]) if kv_dtype is not None else {}
    args = (bt, lens, d**-0.5, window, softcap)
    counters = torch.zeros(b * hkv, dtype=torch.int32, device="cuda") if dtype != torch.float16 else None
    out = rope_decode_attention(q, k, v, cos, sin, *caches[:2], slots, *args, **scales, split_counters=counters,
                                _num_splits=splits)
    assert counters is None or not counters.any()
    same = rope_decode_attention_ref(q, k, v, cos, sin, *ref_caches[:2], slots, *args, **ref_scales)
    q_rot = apply_rope_ref(q, k, cos, sin)[0]
    pages64 = ref_caches[:2] if kv_dtype is not None else [c.double() for c in ref_caches[:2]]
    ref64 = decode_attention_ref(q_rot.double(), *pages64, *args, **ref_scales)
    assert_close_matmul_like(out, ref64, same)
    for got, want in zip(caches, ref_caches, strict=True):
        if kv_dtype is None:
            assert torch.equal(got, want)
        else:  # quantization: the kernel's division may differ from PyTorch's in the last place
            assert (bits(got) == bits(want)).float().mean() > 0.999


def test_rope_and_gated_act_round_as_hf_cuda():
    """Compiled kernels give HF's bf16 values bit for bit (no fused multiply-add across HF's rounding points)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from llmplug.ops.act_mul import act_and_mul
    from llmplug.ops.rope_store_kv import rope_store_kv

    t, dev, bf16 = 200, "cuda", torch.bfloat16
    q, k, v = (torch.randn(t, h, 64, dtype=bf16, device=dev) * 3 for h in (4, 2, 2))
    cos, sin = (torch.randn(t, 64, dtype=bf16, device=dev) for _ in range(2))
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    kc = torch.zeros(t // 16 + 1, 16, 2, 64, dtype=bf16, device=dev)
    rope_store_kv(q, k, v, cos, sin, kc, torch.zeros_like(kc), torch.arange(t, device=dev))
    assert torch.equal(q, q_hf[0].transpose(0, 1)) and torch.equal(k, k_hf[0].transpose(0, 1))
    gate, up = (torch.randn(t, 768, dtype=bf16, device=dev) * 3 for _ in range(2))
    gu = torch.cat([gate, up], -1)
    assert torch.equal(act_and_mul(gu, "silu"), torch.nn.functional.silu(gate) * up)
    assert torch.equal(act_and_mul(gu, "gelu_tanh"), torch.nn.functional.gelu(gate, approximate="tanh") * up)


def test_add_norm_gemv_cuda():
    """The norm in the GEMV's prologue: the residual bit for bit, the output as add_rms_norm + gemv within an ulp's
    effect (the mean square summed in another order)."""
    from llmplug.ops.gemv import add_norm_gemv, gemv
    from llmplug.ops.rms_norm import add_rms_norm

    for k, n, gated, offset in ((2048, 3072, "", 0.0), (4096, 28672, "silu", 0.0), (2304, 18432, "gelu_tanh", 1.0)):
        x, r = (torch.randn(1, k, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        nw = torch.rand(k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        y, res = add_norm_gemv(x, r, nw, 1e-5, offset, w, gated=gated)
        normed, res_ref = add_rms_norm(x, r, nw, 1e-5, offset)
        assert torch.equal(res, res_ref)
        torch.testing.assert_close(y, gemv(normed, w, gated=gated), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("d,h,hkv,window,softcap", [(128, 32, 8, -1, 0.0), (64, 16, 16, 100, 0.0),
                                                     (256, 8, 4, 300, 50.0), (80, 12, 4, -1, 0.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_attention_cuda(d, h, hkv, window, softcap, dtype):
    new = [1, 300, 77, 1024]
    ctx = [0, 45, 700, 0]
    p = 16
    kc, vc, bt = _paged(len(new), max(c + n for c, n in zip(ctx, new)), hkv, d, p, dtype)
    t = sum(new)
    q = torch.randn(t, h, d, dtype=dtype, device="cuda")
    k = torch.randn(t, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cl = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    args = (bt, cu, cl, max(new), d**-0.5, window, softcap)
    out = prefill_attention(q, k, v, kc, vc, *args)
    ref64 = prefill_attention_ref(q.double(), k.double(), v.double(), kc.double(), vc.double(), *args)
    same = prefill_attention_ref(q, k, v, kc, vc, *args)
    assert_close_matmul_like(out, ref64, same)


@pytest.mark.parametrize("family", sorted(FUSED) + sorted(GENERIC))
def test_family_greedy_fp32_cuda_graphs(family):
    model = make_model(family).cuda()
    ids, mask = pad(prompts(5, lengths=(5, 13, 2, 8, 30)))
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    expected = model.generate(**kw)
    llmplug.optimize(model, graph_batch_sizes=(1, 2, 8))
    got = model.generate(**kw)
    assert state_of(model).runner._graphs, "decode did not go through a CUDA graph"
    assert torch.equal(got, expected)
    one = model.generate(input_ids=ids[:1, -5:], max_new_tokens=20, do_sample=False)
    assert ("prefill", 64) in state_of(model).runner._graphs, "single-prompt prefill did not replay a graph"
    llmplug.unoptimize(model)
    assert torch.equal(one, model.generate(input_ids=ids[:1, -5:], max_new_tokens=20, do_sample=False))


def test_dynamic_rope_runs_without_graphs():
    import transformers as tf

    from tests.tiny_models import COMMON

    config = tf.LlamaConfig(**{**COMMON, "max_position_embeddings": 64},
                            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = tf.AutoModelForCausalLM.from_config(config).cuda().eval()
    ids = torch.tensor(prompts(1, lengths=(70,)), device="cuda")
    expected = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
    llmplug.optimize(model, max_model_len=128)
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=10, do_sample=False), expected)
    assert not state_of(model).runner._graphs


def test_eos_and_max_length_on_the_deferred_stop_path():
    """Rows finishing on EOS at different steps, every max_new_tokens: same sequences (and shapes) as stock HF."""
    model = make_model("llama").cuda()
    ids, mask = (t.cuda() for t in pad(prompts(3)))
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)[:, ids.shape[1]:]
    eos = [int(free[0, 3]), int(free[1, 5]), int(free[2, 1])]
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, eos_token_id=eos)
    expected = {n: model.generate(**kw, max_new_tokens=n) for n in range(1, 13)}
    llmplug.optimize(model)
    for n, want in expected.items():
        assert torch.equal(model.generate(**kw, max_new_tokens=n), want), n


def test_greedy_graph_over_several_rings_and_pages():
    """The on-device greedy loop (one graph replay a step) across rings of steps and KV pages: rows finish at
    different steps, the loop stops after the last one (learned a ring late), limits that are not ring multiples."""
    model = make_model("llama").cuda()
    ids, mask = (t.cuda() for t in pad(prompts(3)))
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=70, do_sample=False)[:, ids.shape[1]:]
    eos = [int(free[0, 44]), int(free[1, 20]), int(free[2, 5])]
    runs = [dict(max_new_tokens=n, eos_token_id=e) for n in (17, 33, 70) for e in (eos, None)]
    expected = [model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw) for kw in runs]
    llmplug.optimize(model, graph_batch_sizes=(1, 4))
    for kw, want in zip(runs, expected):
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw), want), kw
    assert ("greedy", 4) in state_of(model).runner._graphs


def test_sampling_graph_matches_stock_seeded_samples():
    """Seeded sampling with stateless warpers runs one graph replay a step and draws HF's own samples: same tokens
    as stock HF for a seed, the random stream left where stock HF leaves it, other seeds differ, rows finish on eos."""
    model = make_model("llama").cuda()
    ids, mask = (t.cuda() for t in pad(prompts(3)))
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.9, top_k=40, top_p=0.9, min_p=0.01,
              max_new_tokens=40)

    def run(seed, **extra):
        torch.manual_seed(seed)
        out = model.generate(**kw, **extra)
        return out, torch.rand(1, device="cuda")

    expected = [run(seed, eos_token_id=eos) for seed in (3, 4) for eos in (None, [5, 9, 17])]
    llmplug.optimize(model, graph_batch_sizes=(1, 4))
    got = [run(seed, eos_token_id=eos) for seed in (3, 4) for eos in (None, [5, 9, 17])]
    for (want, want_next), (out, out_next) in zip(expected, got):
        assert torch.equal(out, want) and torch.equal(out_next, want_next)
    assert not torch.equal(got[0][0], got[2][0])
    assert any(k[0] == "sample" and k[1] == 3 for k in state_of(model).runner._graphs)


class _TailStop:
    """A stateful harness-style criterion: a row is done once its newest token is in ``stops``; rows stay done."""

    def __init__(self, stops):
        self.stops, self.done, self.calls = stops, None, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        last = input_ids[:, -1].tolist()
        self.done = [d or t in self.stops for d, t in zip(self.done or [False] * len(last), last)]
        return torch.tensor(self.done, device=input_ids.device)


@pytest.mark.parametrize("do_sample", [False, True])
def test_user_stopping_criteria_stay_on_the_graph_loop(do_sample):
    """A Python criterion (stateful, reading tokens on the host) runs a ring of steps late beside the graph loop:
    stock HF's tokens, the criterion called as often as stock calls it, with eos ids too and without."""
    from transformers import StoppingCriteriaList

    model = make_model("llama").cuda()
    ids, mask = (t.cuda() for t in pad(prompts(3)))
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=60, do_sample=False)[:, ids.shape[1]:]
    stops = {int(free[0, 40]), int(free[1, 18])}
    sample = dict(do_sample=True, temperature=0.9, top_k=40) if do_sample else dict(do_sample=False)

    def run(eos):
        torch.manual_seed(5)
        crit = _TailStop(stops)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=60, eos_token_id=eos,
                             stopping_criteria=StoppingCriteriaList([crit]), **sample)
        return out, crit.calls

    eos_ids = [None, [int(free[2, 30])]]
    expected = [run(e) for e in eos_ids]
    llmplug.optimize(model, graph_batch_sizes=(1, 4))
    for e, (want, calls) in zip(eos_ids, expected):
        out, got_calls = run(e)
        assert torch.equal(out, want) and got_calls == calls, (e, got_calls, calls)
    assert any(k[0] in ("greedy", "sample") for k in state_of(model).runner._graphs)


def test_returned_cache_on_cuda_continues_like_stock():
    from llmplug.engine.hf_cache import CACHE_FIELD

    model = make_model("llama").cuda()
    ids, mask = (t.cuda() for t in pad(prompts(3)))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    want = model.generate(**kw)
    llmplug.optimize(model)
    got = model.generate(**kw)
    assert torch.equal(got.sequences, want.sequences)
    real = torch.cat([mask, torch.ones_like(mask[:, :1]).expand(-1, 19)], 1).bool()
    for la, lb in zip(getattr(want, CACHE_FIELD).layers, getattr(got, CACHE_FIELD).layers):
        torch.testing.assert_close(lb.keys.transpose(1, 2)[real], la.keys.transpose(1, 2)[real])
        torch.testing.assert_close(lb.values.transpose(1, 2)[real], la.values.transpose(1, 2)[real])


@pytest.mark.parametrize("rows,vocab", [(1, 128256), (5, 32000), (64, 151936)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_step_cuda(rows, vocab, dtype):
    from llmplug.ops.greedy_step import greedy_step, greedy_step_ref

    logits = torch.randn(rows, vocab, device="cuda").to(dtype)
    logits[:, [vocab // 3, vocab - 1]] = logits.max() + 1  # a tie across partial blocks: the first index wins
    state = [torch.rand(rows, device="cuda") < 0.8, torch.tensor([5, vocab // 3, -1, -1], device="cuda"),
             torch.tensor([0], device="cuda"), torch.zeros(rows, 16, dtype=torch.long, device="cuda"),
             torch.zeros(rows, dtype=torch.long, device="cuda"), torch.arange(rows, device="cuda") - 1,
             torch.randint(0, 4, (rows,), device="cuda"), torch.tensor([21, 4], device="cuda")]
    want = [t.clone() for t in state]
    greedy_step_ref(logits, *want)
    greedy_step(logits, *state)
    for got, exp in zip(state, want):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("ahead", [1, 3])
def test_engine_greedy_fp32_matches_stock_per_request(family, mode, ahead):
    """Engine on CUDA (graphs, ``ahead`` steps in flight, chunked prefill, preemption forced by a small pool, prefix
    hits from a shared prefix, n > 1) gives each greedy request stock HF's tokens for that prompt alone."""
    torch.manual_seed(0)
    stock = make_model(family).cuda()
    fast = make_model(family).cuda()
    fast.load_state_dict(stock.state_dict())
    llmplug.optimize(fast, kv_num_blocks=24, kv_block_size=8)
    config = llmplug.EngineConfig(max_num_batched_tokens=32, preemption_mode=mode, swap_space_gb=0.001,
                                  steps_ahead=ahead)
    engine = llmplug.Engine(fast, config)
    engine.warmup()
    shared = prompts(1, lengths=(17,), seed=3)[0]
    rows = [shared + p for p in prompts(6, lengths=(5, 30, 3, 12, 1, 8))] + prompts(4, lengths=(40, 2, 9, 21), seed=5)
    params = llmplug.SamplingParams(max_new_tokens=24, do_sample=False, ignore_eos=True)
    outs = engine.generate(rows, params, progress=False)
    for row, out in zip(rows, outs):
        ref = stock.generate(torch.tensor([row], device="cuda"), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(row):].tolist()
        assert out.outputs[0].token_ids == ref
    assert engine.stats()["prefix_hit_rate"] > 0
    triple = engine.generate(rows[:2], llmplug.SamplingParams(max_new_tokens=24, do_sample=False, ignore_eos=True,
                                                              n=3), progress=False)
    for out, single in zip(triple, outs):
        assert [c.token_ids for c in out.outputs] == [single.outputs[0].token_ids] * 3
    assert engine.blocks.num_used == 0
