"""Prefix-cached KV never outlives the weights it was computed with: an RL loop updates the weights in place between
``generate`` calls (or Engine requests), and the next call must answer with the new weights (fp32 CPU, references)."""

import torch

import llmplug
from llmplug.state import state_of
from tests.tiny_models import make_model, pad, prompts, reference_kernels


def _update(*models):
    with torch.no_grad():
        for m in models:
            for p in m.parameters():
                p.mul_(1.2)  # an optimizer step: in place, on the parameters llmplug fused into views


def test_generate_after_an_in_place_weight_update():
    with reference_kernels():
        stock = make_model("llama")
        fast = make_model("llama")
        fast.load_state_dict(stock.state_dict())
        llmplug.Engine(llmplug.optimize(fast))  # an Engine turns the pool's prefix cache on
        blocks = state_of(fast).runner.cache.blocks
        ids, mask = pad(prompts(2, lengths=(40, 37)))  # full 16-token blocks to cache
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert torch.equal(fast.generate(**kw), stock.generate(**kw))
        assert torch.equal(fast.generate(**kw), stock.generate(**kw)) and blocks.stats.hit_tokens > 0  # reused
        _update(stock, fast)
        hits = blocks.stats.hit_tokens
        assert torch.equal(fast.generate(**kw), stock.generate(**kw))  # stale KV gave other tokens before
        assert blocks.stats.hit_tokens == hits


def test_engine_after_an_in_place_weight_update():
    with reference_kernels():
        stock = make_model("llama")
        fast = make_model("llama")
        fast.load_state_dict(stock.state_dict())
        engine = llmplug.Engine(llmplug.optimize(fast))
        prompt = prompts(1, lengths=(40,))[0]
        params = llmplug.SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0)
        engine.generate([prompt], params, progress=False)
        _update(stock, fast)
        got = engine.generate([prompt], params, progress=False)[0].outputs[0].token_ids
        want = stock.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want


def test_inference_tensor_weights_say_the_prefix_cache_is_dropped():
    """Weights made under ``torch.inference_mode`` keep no version counter: llmplug cannot see their in-place updates,
    so it drops the prefix cache when prompts arrive (correct, not fast) and says so once."""
    import warnings

    with reference_kernels():
        with torch.inference_mode():
            fast = make_model("llama")
        engine = llmplug.Engine(llmplug.optimize(fast))
        params = llmplug.SamplingParams(max_new_tokens=2, temperature=0.0)
        prompt = prompts(1, lengths=(40,))[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.generate([prompt], params, progress=False)
            engine.generate([prompt], params, progress=False)
        said = [w for w in caught if "inference tensors" in str(w.message)]
        assert len(said) == 1
        assert state_of(fast).runner.cache.blocks.stats.hit_tokens == 0
