"""``llmplug.quantize`` and ``optimize(quantize=...)`` on tiny HF models (CPU, fp32): which linears are replaced,
and llmplug's generate on a quantized model is token-identical to stock HF generate on the same quantized model.

Models run the ops' references (``cpu_kernels(False)``), as CPU users do; the interpreted kernels are checked op by
op in test_quant_ops.py and once end to end here.
"""

import pytest
import torch

import llmplug
from llmplug.ops._triton import cpu_kernels
from llmplug.quant import QuantLinear
from llmplug.state import state_of
from tests.tiny_models import make_model, pad, prompts


def _quantized_names(model):
    return sorted(n for n, m in model.named_modules() if isinstance(m, QuantLinear))


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantize_replaces_linears_but_not_lm_head_or_embeddings(method):
    model = make_model("llama")
    linears = sorted(n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n != "lm_head")
    llmplug.quantize(model, method, group_size=32)
    assert _quantized_names(model) == linears
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding
    record = model._llmplug_quantization
    assert (record["method"], record["group_size"]) == (method, 32 if method == "int4" else None)
    assert sorted(record["modules"]) == linears
    q = model.model.layers[0].mlp.down_proj
    assert q.qweight.dtype == {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}[method]


def test_exclude_and_filter():
    model = make_model("llama")
    llmplug.quantize(model, "int8", exclude=("lm_head", "*mlp*"), filter=lambda name, mod: "layers.0." in name)
    assert _quantized_names(model) == [f"model.layers.0.self_attn.{p}_proj" for p in "koqv"]


def test_int4_skips_widths_the_group_does_not_divide():
    model = make_model("llama")  # hidden 64, intermediate 96: down_proj's 96 inputs are not groups of 64
    llmplug.quantize(model, "int4", group_size=64)
    names = _quantized_names(model)
    assert "model.layers.0.mlp.down_proj" not in names and "model.layers.0.mlp.up_proj" in names


def test_bad_arguments():
    model = make_model("llama")
    with pytest.raises(ValueError, match="method='int3'"):
        llmplug.quantize(model, "int3")
    with pytest.raises(ValueError, match="group_size=100"):
        llmplug.quantize(model, "int4", group_size=100)
    with pytest.raises(ValueError, match="quantize='nf4'"):
        llmplug.optimize(model, quantize="nf4")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16'"):
        llmplug.optimize(model, kv_cache_dtype="fp16")
    llmplug.quantize(model, "int8")
    with pytest.raises(ValueError, match="already quantized as int8"):
        llmplug.quantize(model, "fp8")


@pytest.fixture
def references():
    with cpu_kernels(False):
        yield


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3", "olmo2"])
@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_generate_identical_to_stock_on_the_quantized_model(family, method, references):
    model = make_model(family)
    llmplug.quantize(model, method, group_size=32)
    ids, mask = pad(prompts(3))
    stock = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    llmplug.optimize(model, quantize=method, group_size=32)  # already quantized: a no-op for the weights
    ours = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours, stock)
    llmplug.unoptimize(model)
    assert _quantized_names(model), "unoptimize keeps the quantized linears"
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False), stock)


def test_interpreted_kernels_end_to_end():
    """The Triton kernels (interpreted) in llmplug's generate give the tokens the references give."""
    model = make_model("llama")
    llmplug.optimize(model, quantize="int4", group_size=32)
    ids, mask = pad(prompts(2, lengths=(5, 3)))
    with cpu_kernels(False):
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    with cpu_kernels(True):
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("exclude", [("lm_head",), ()])
def test_optimize_quantizes_and_the_engine_runs(references, exclude):
    model = make_model("llama")
    model.generation_config.eos_token_id = None
    llmplug.optimize(model, quantize="int4", group_size=32, quantize_exclude=exclude)
    assert _quantized_names(model)
    assert isinstance(model.lm_head, QuantLinear) == (exclude == ())
    rows = prompts(4)
    ids, mask = pad(rows)
    want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)[:, ids.shape[1]:]
    engine = llmplug.Engine(model)
    outs = engine.generate(rows, llmplug.SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want.tolist()


def test_fused_projections_share_storage_with_the_modules():
    model = make_model("llama")
    llmplug.optimize(model, quantize="int8")
    attn = model.model.layers[0].self_attn
    fused = state_of(model).runner.forward_fn.layers[0].qkv
    assert attn.q_proj.qweight.data_ptr() == fused.qweight.data_ptr()
    assert attn.k_proj.qweight.data_ptr() == fused.qweight[attn.q_proj.out_features:].data_ptr()
    llmplug.unoptimize(model)
    assert attn.k_proj.qweight.is_contiguous() and attn.k_proj.qweight.data_ptr() != fused.qweight.data_ptr()
