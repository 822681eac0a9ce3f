"""``save_quantized`` / ``from_quantized`` and the ``"llmplug"`` HF quantizer on tiny models (CPU, fp32): every tensor
bit-identical after a round trip, identical logits and greedy tokens, quantize-on-load, and clear errors.

Models run the ops' references (``cpu_kernels(False)``): what is checked here is the checkpoint, not the kernels.
"""

import json

import pytest
import torch
import transformers as tf
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

import llmplug
from llmplug.ops._triton import cpu_kernels
from llmplug.quant import LlmplugQuantConfig, QuantLinear, hf_quantizer
from llmplug.quant.hf_quantizer import LlmplugHfQuantizer, register, replace_with_empty_quant_linears
from tests.tiny_models import make_model, pad, prompts
from tests.tiny_tokenizer import make_tokenizer

METHODS = ["int8", "int4", "fp8"]


@pytest.fixture(autouse=True)
def _reference_ops():
    with cpu_kernels(False):
        yield


def _quantized(family="llama", method="int8", dtype=torch.float32, exclude=("lm_head",)):
    return llmplug.quantize(make_model(family, dtype), method, group_size=32, exclude=exclude)


def _assert_same_tensors(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name, x in sa.items():
        y = sb[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), name  # fp8: bytes


def _generate(model, ids, mask):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)


def _assert_same_outputs(a, b):
    ids, mask = pad(prompts(2, lengths=(5, 9)))
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids, attention_mask=mask).logits, b(input_ids=ids, attention_mask=mask).logits)
    assert torch.equal(_generate(a, ids, mask), _generate(b, ids, mask))


def _load(path, loader):
    return llmplug.from_quantized(path) if loader == "from_quantized" else tf.AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("loader", ["from_quantized", "from_pretrained"])
@pytest.mark.parametrize("method", METHODS)
def test_round_trip_is_bit_exact(method, loader, tmp_path):
    model = _quantized("llama", method)
    llmplug.save_quantized(model, tmp_path)
    loaded = _load(tmp_path, loader)
    assert not loaded.training and isinstance(loaded.hf_quantizer, LlmplugHfQuantizer)
    assert loaded._llmplug_quantization == model._llmplug_quantization
    _assert_same_tensors(model, loaded)
    _assert_same_outputs(model, loaded)


@pytest.mark.parametrize("family, method, exclude", [
    ("qwen2", "int4", ("lm_head",)),  # q/k/v biases
    ("gemma", "int8", ("lm_head",)),  # tied embeddings, lm_head kept dense
    ("gemma", "fp8", ()),  # tied embeddings, lm_head quantized: the tie is gone
    ("gemma3_text", "int4", ("lm_head",)),
])
def test_round_trip_families(family, method, exclude, tmp_path):
    model = _quantized(family, method, exclude=exclude)
    llmplug.save_quantized(model, tmp_path)
    loaded = llmplug.from_quantized(tmp_path)
    _assert_same_tensors(model, loaded)
    _assert_same_outputs(model, loaded)
    assert all(not p.requires_grad for m in loaded.modules() if isinstance(m, QuantLinear) for p in m.parameters())


@pytest.mark.parametrize("method", METHODS)
def test_bf16_round_trip_keeps_buffer_dtypes(method, tmp_path):
    model = _quantized("qwen2", method, torch.bfloat16)
    llmplug.save_quantized(model, tmp_path)
    loaded = llmplug.from_quantized(tmp_path)
    assert loaded.dtype == torch.bfloat16
    _assert_same_tensors(model, loaded)  # int8 / fp8 scales stay fp32, int4 scales and zeros bf16
    upcast = llmplug.from_quantized(tmp_path, device="cpu", dtype=torch.float32)
    q = upcast.model.layers[0].self_attn.q_proj
    assert upcast.dtype == torch.float32 and q.bias.dtype == torch.float32 and q.qweight.dtype != torch.float32


def test_checkpoint_files(tmp_path):
    model = _quantized("llama", "int4")
    llmplug.save_quantized(model, tmp_path, tokenizer=make_tokenizer())
    files = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
    assert not {f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))}
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert quant == {"quant_method": "llmplug", "method": "int4", "group_size": 32,
                     "modules": model._llmplug_quantization["modules"], "permuted": []}
    assert not hasattr(model.config, "quantization_config"), "save_quantized left the model's config as it was"


@pytest.mark.parametrize("loader", ["from_quantized", "from_pretrained"])
def test_permuted_inputs_round_trip(loader, tmp_path):
    """Act-order GPTQ imports gather their inputs by ``perm``: the checkpoint keeps it and lists those modules."""
    model = _quantized("llama", "int4")
    attn = model.model.layers[1].self_attn
    perm = torch.randperm(64)
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        proj.perm = perm
    llmplug.save_quantized(model, tmp_path)
    loaded = _load(tmp_path, loader)
    assert loaded.config.quantization_config.permuted == [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    _assert_same_tensors(model, loaded)
    _assert_same_outputs(model, loaded)
    attn = loaded.model.layers[1].self_attn
    attn.k_proj.perm = attn.v_proj.perm = attn.q_proj.perm  # aliases again; the loaded model saves through HF
    loaded.save_pretrained(tmp_path / "again")
    _assert_same_tensors(model, _load(tmp_path / "again", loader))


def test_sharded_checkpoint(tmp_path):
    model = _quantized("llama", "int8")
    llmplug.save_quantized(model, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _assert_same_tensors(model, llmplug.from_quantized(tmp_path))


@pytest.mark.parametrize("method", METHODS)
def test_optimize_loaded_model(method, tmp_path):
    llmplug.save_quantized(_quantized("llama", method), tmp_path)
    loaded = llmplug.from_quantized(tmp_path)
    ids, mask = pad(prompts(3, lengths=(5, 11, 3)))
    expected = _generate(loaded, ids, mask)
    llmplug.optimize(loaded)
    assert torch.equal(_generate(loaded, ids, mask), expected)


def test_save_optimized_model(tmp_path):
    """The views of fused q/k/v and gate/up buffers are written as the modules' own tensors."""
    model = llmplug.optimize(_quantized("qwen2", "int4"))
    llmplug.save_quantized(model, tmp_path)
    loaded = llmplug.from_quantized(tmp_path)
    llmplug.unoptimize(model)
    _assert_same_tensors(model, loaded)


@pytest.mark.parametrize("method", METHODS)
def test_quantize_on_load(method, tmp_path):
    make_model("llama").save_pretrained(tmp_path / "dense")
    config = LlmplugQuantConfig(method, group_size=32)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=config)
    expected = llmplug.quantize(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "dense"), method, 32)
    _assert_same_tensors(model, expected)
    assert model._llmplug_quantization == expected._llmplug_quantization
    assert model.config.quantization_config.modules == expected._llmplug_quantization["modules"]
    model.save_pretrained(tmp_path / "quant")  # the HF quantizer is serializable: save_pretrained writes a checkpoint
    _assert_same_tensors(model, llmplug.from_quantized(tmp_path / "quant"))


def test_quantizer_registration_and_flags(tmp_path, monkeypatch):
    assert AUTO_QUANTIZER_MAPPING["llmplug"] is LlmplugHfQuantizer
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["llmplug"] is LlmplugQuantConfig
    register()  # idempotent
    llmplug.save_quantized(_quantized("llama", "int8"), tmp_path)
    devices = set()

    def replace(model, config):  # the skeleton is built on the meta device: no dense weight is allocated
        names = replace_with_empty_quant_linears(model, config)
        devices.update(t.device.type for t in [*model.parameters(), *model.buffers()])
        return names

    monkeypatch.setattr(hf_quantizer, "replace_with_empty_quant_linears", replace)
    quantizer = llmplug.from_quantized(tmp_path).hf_quantizer
    assert devices == {"meta"}
    assert quantizer.is_serializable() and quantizer.is_compileable and not quantizer.is_trainable


def test_base_model_loads_causal_lm_checkpoint(tmp_path):
    """``AutoModel`` on a causal-LM checkpoint drops the ``model.`` prefix and the head, as for dense weights."""
    model = _quantized("llama", "int4", exclude=())
    llmplug.save_quantized(model, tmp_path)
    base = tf.AutoModel.from_pretrained(tmp_path)
    assert base._llmplug_quantization["modules"] == [n.removeprefix("model.") for n in
                                                     model._llmplug_quantization["modules"] if n != "lm_head"]
    ids, mask = pad(prompts(2))
    with torch.no_grad():
        expected = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert torch.equal(base(input_ids=ids, attention_mask=mask).last_hidden_state, expected)


@pytest.mark.parametrize("method", METHODS)
def test_loaded_linear_compiles(method, tmp_path):
    model = _quantized("llama", method)
    llmplug.save_quantized(model, tmp_path)
    linear = llmplug.from_quantized(tmp_path).model.layers[0].mlp.gate_proj
    x = torch.randn(3, 64)
    compiled = torch.compile(linear, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), linear(x))


def test_config_validation():
    assert LlmplugQuantConfig("int8").group_size is None
    with pytest.raises(ValueError, match="method='int3'.*int8"):
        LlmplugQuantConfig("int3")
    with pytest.raises(ValueError, match="group_size=100"):
        LlmplugQuantConfig("int4", group_size=100)
    with pytest.raises(ValueError, match="quant_method='gptq'"):
        LlmplugQuantConfig.from_dict({"quant_method": "gptq", "method": "int8"})
    with pytest.raises(ValueError, match="modules"):
        LlmplugQuantConfig("int8", modules="model.layers.0.mlp.up_proj")


def _edit_quant_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config["quantization_config"][key]
    (path / "config.json").write_text(json.dumps(config))


def test_bad_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        llmplug.from_quantized(tmp_path / "missing")
    with pytest.raises(ValueError, match="not quantized by llmplug"):
        llmplug.save_quantized(make_model("llama"), tmp_path)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        llmplug.save_quantized(torch.nn.Linear(2, 2), tmp_path)
    make_model("llama").save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="quant_method is None"):
        llmplug.from_quantized(tmp_path / "dense")
    path = tmp_path / "quant"
    llmplug.save_quantized(_quantized("llama", "int8"), path)
    (path / "model.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        llmplug.from_quantized(path)
    (tmp_path / "moved.safetensors").rename(path / "model.safetensors")
    for changes, message in [({"method": "int3"}, "method='int3'"), ({"modules": None}, "no 'modules' list"),
                             ({"modules": ["model.layers.0.mlp.nope"]}, "'model.layers.0.mlp.nope'"),
                             ({"modules": ["model.embed_tokens"]}, "not an nn.Linear")]:
        original = (path / "config.json").read_text()
        _edit_quant_config(path, **changes)
        for loader in ("from_quantized", "from_pretrained"):
            with pytest.raises(ValueError, match=message):
                _load(path, loader)
        (path / "config.json").write_text(original)
