"""``kv_cache_dtype="fp8"`` / ``"int8"`` end to end on CPU: HF ``generate`` and the ``Engine`` on tiny fp32 models.

A lossy cache lets a random tiny model flip near-tie tokens (and diverge from there), so generations are checked by
the logits llmplug produced against stock HF's logits for the same (llmplug-generated) tokens, not token equality.
"""

import copy

import pytest
import torch
import transformers as tf

import llmplug
from llmplug import Engine, EngineConfig
from llmplug.kv.cache import PagedKVCache
from llmplug.ops._triton import cpu_kernels
from llmplug.quant.formats import sqnr_db
from llmplug.state import state_of
from tests.engine.test_engine import greedy
from tests.tiny_models import make_model, pad, prompts

# Logits of the tiny fp32 models (weights ~N(0, 0.25)) vs stock HF on the same tokens, measured over llama, gpt2 and
# qwen3 with three seeds: int8 36-41 dB, fp8 23-28 dB.
LOGITS_SQNR_DB = {"int8": 30.0, "fp8": 18.0}
KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _teacher_forced_sqnr(stock, out, ids, mask) -> float:
    """SQNR (dB) of llmplug's generation scores against stock HF's logits over the generated sequences."""
    seqs = out.sequences
    full_mask = torch.cat([mask, torch.ones_like(seqs[:, ids.shape[1]:])], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = stock(input_ids=seqs, attention_mask=full_mask, position_ids=positions).logits
    want = logits[:, ids.shape[1] - 1:-1].transpose(0, 1)  # (steps, B, V): the logits that chose each new token
    return sqnr_db(want, torch.stack(out.scores))


@pytest.mark.parametrize("family, kernels, kv", [
    ("llama", False, "int8"), ("llama", False, "fp8"), ("llama", True, "fp8"), ("gpt2", False, "int8"),
    ("gpt2", False, "fp8"),
])
def test_generate_with_quantized_kv_cache(family, kernels, kv):
    """Fused (llama) and generic (gpt2, through ``AttentionInterface``) forwards; references and interpreted kernels."""
    stock = make_model(family)
    ids, mask = pad(prompts(3, lengths=(5, 13, 2)))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    expected = stock.generate(**kw)
    model = copy.deepcopy(stock)
    llmplug.optimize(model, kv_cache_dtype=kv, kv_num_blocks=16)
    with cpu_kernels(kernels):
        out = model.generate(**kw, output_scores=True, return_dict_in_generate=True)
    cache = state_of(model).runner.cache
    assert cache.k.dtype == KV_DTYPES[kv] and cache.k_scale is not None
    # the first token comes from the prefill, which reads the prompt's own k/v unquantized
    assert torch.equal(out.sequences[:, ids.shape[1]], expected[:, ids.shape[1]])
    assert _teacher_forced_sqnr(stock, out, ids, mask) >= LOGITS_SQNR_DB[kv]


def _quantized_engine(stock, kv: str, num_blocks: int) -> Engine:
    fast = copy.deepcopy(stock)
    llmplug.optimize(fast, kv_num_blocks=num_blocks, kv_block_size=8, kv_cache_dtype=kv)
    swap_gb = 6 * state_of(fast).runner.ensure_cache().block_bytes / 1e9
    return Engine(fast, EngineConfig(preemption_mode="swap", swap_space_gb=swap_gb, max_num_batched_tokens=64,
                                     enable_prefix_caching=True))


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_engine_swaps_and_copies_quantized_blocks_losslessly(kv):
    """A small pool swaps requests out and back and shares blocks copy-on-write (n=2): the tokens equal those of a
    pool large enough for everything at once, so pages and scales travel together."""
    stock = make_model("llama")
    lengths, news = (10, 25, 17, 30, 5, 21), (20, 14, 18, 9, 24, 16)
    rows = prompts(len(lengths), lengths=lengths)
    params = [greedy(n, n=2 if i == 1 else 1) for i, n in enumerate(news)]
    outputs = {}
    with cpu_kernels(False):
        for num_blocks in (10, 200):
            engine = _quantized_engine(stock, kv, num_blocks)
            outs = engine.generate(rows, params, progress=False)
            outputs[num_blocks] = [o.token_ids for out in outs for o in out.outputs]
            assert (engine.scheduler.num_preemptions > 0) == (num_blocks == 10)
    assert outputs[10] == outputs[200]
    assert outputs[10][1] == outputs[10][2], "the two greedy samples sharing their prompt's blocks differ"


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_same_memory_holds_about_twice_the_blocks(kv, monkeypatch):
    """``kv_memory_fraction`` sizing: ~1.9x the blocks of the bf16 pool for head dim 128 (scales included)."""
    monkeypatch.setattr(PagedKVCache, "budget_bytes", staticmethod(lambda device, fraction: 64 << 20))
    config = tf.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=256)
    blocks = {}
    for dtype in ("auto", kv):
        model = tf.LlamaForCausalLM(config).to(torch.bfloat16).eval()
        llmplug.optimize(model, kv_cache_dtype=dtype)
        blocks[dtype] = state_of(model).runner.ensure_cache().num_blocks
    assert 1.9 <= blocks[kv] / blocks["auto"] < 2.0
