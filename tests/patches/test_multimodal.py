"""Multimodal wrappers (Gemma3ForConditionalGeneration, Llava): llmplug runs their text stack on text-only prompts,
token-identical to stock HF; inputs it cannot run (images) go to stock generate."""

import copy

import pytest
import torch

import llmplug
from llmplug.engine.runner import hf_forward
from llmplug.patches.decoder import FusedDecoder
from llmplug.state import state_of
from tests.tiny_models import IMAGE_TOKENS, TEXT_VOCAB, make_model, pad, prompts, reference_kernels


def _generate(model, ids, mask, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, **kw)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("name", ["gemma3", "llava"])
def test_text_only_greedy_matches_stock_hf(name, fuse):
    model = make_model(name)
    stock = copy.deepcopy(model)
    ids, mask = pad(prompts(4, lengths=(5, 13, 2, 8), vocab=TEXT_VOCAB))
    expected = _generate(stock, ids, mask)
    llmplug.optimize(model, fuse=fuse)
    forward = state_of(model).runner.forward_fn
    assert isinstance(forward, FusedDecoder) if fuse else forward is hf_forward
    if fuse:  # the fused forward runs the wrapper's text stack
        assert forward.base is model.model.language_model
    with reference_kernels():
        got = _generate(model, ids, mask)
    assert torch.equal(got, expected)
    assert len(set(got[:, ids.shape[1]:].flatten().tolist())) > 8, "degenerate model output: test cannot fail"


def test_gemma3_wrapper_unoptimize_restores_bit_identical_logits():
    model = make_model("gemma3")
    ids, mask = pad(prompts(2, vocab=TEXT_VOCAB))
    before = model(input_ids=ids, attention_mask=mask).logits
    params = dict(model.named_parameters())
    data = {n: p.detach().clone() for n, p in params.items()}
    llmplug.optimize(model)
    with reference_kernels():
        _generate(model, ids, mask)
    llmplug.unoptimize(model)
    assert not llmplug.is_optimized(model) and "generate" not in model.__dict__
    for n, p in model.named_parameters():
        assert p is params[n] and p.is_contiguous() and torch.equal(p, data[n]), n
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)


def test_gemma3_wrapper_with_logit_cap_matches_stock_logits():
    """Gemma 3's wrapper ignores its text config's final logit cap (Gemma3ForCausalLM applies it): such a model runs
    the generic path, and its logits are the wrapper's."""
    model = make_model("gemma3", final_logit_softcapping=5.0)
    stock = copy.deepcopy(model)
    ids, mask = pad(prompts(3, lengths=(5, 9, 2), vocab=TEXT_VOCAB))
    kw = dict(return_dict_in_generate=True, output_logits=True)
    expected = _generate(stock, ids, mask, **kw)
    assert torch.stack(expected.logits).abs().max() > 5.0, "logits within the cap: test cannot fail"
    llmplug.optimize(model)
    with reference_kernels():
        got = _generate(model, ids, mask, **kw)
    assert torch.equal(got.sequences, expected.sequences)
    for step, (ours, theirs) in enumerate(zip(got.logits, expected.logits, strict=True)):
        torch.testing.assert_close(ours, theirs, msg=f"step {step}")


def test_gemma3_images_fall_back_to_stock_generate():
    """Pixel values (with the processor's token_type_ids marking image tokens) run on stock HF generate."""
    model = make_model("gemma3")
    stock = copy.deepcopy(model)
    boi, eoi, image_token = (IMAGE_TOKENS[k] for k in ("boi_token_index", "eoi_token_index", "image_token_index"))
    image = [boi] + [image_token] * model.config.mm_tokens_per_image + [eoi]
    rows = [p[:2] + image + p[2:] for p in prompts(2, lengths=(5, 9), vocab=TEXT_VOCAB)]
    ids, mask = pad(rows)
    kw = dict(pixel_values=torch.randn(2, 3, 28, 28), token_type_ids=(ids == image_token).long())
    expected = _generate(stock, ids, mask, **kw)
    llmplug.optimize(model)
    with reference_kernels():
        got = _generate(model, ids, mask, **kw)
    assert torch.equal(got, expected)
    assert not torch.equal(expected, _generate(stock, ids, mask, **{**kw, "pixel_values": -kw["pixel_values"]})), \
        "the image does not change the output: test cannot fail"
