"""GPTQ / AWQ import (``llmplug.quant.import_4bit``) against checkpoints packed here in the on-disk formats.

The packers and the reference dequantisers below are written from the format descriptions (AutoGPTQ's
``qlinear_cuda_old.pack``, AutoAWQ's ``WQLinear_GEMM.from_linear`` and ``packing_utils``), by index arithmetic
rather than the importer's reshapes, and pinned to known words (GPTQ's symmetric v1 ``0x77777777``).
"""

import json

import pytest
import torch
from safetensors.torch import save_file

import llmplug
from llmplug.ops._triton import cpu_kernels
from llmplug.patches.undo import UndoLog
from llmplug.quant.formats import sqnr_db
from llmplug.quant.import_4bit import awq_linear, gptq_linear
from llmplug.quant.linear import QuantLinear, fuse_quant_linears
from llmplug.state import state_of
from tests.tiny_models import make_model, pad, prompts
from tests.tolerances import assert_close_matmul_like

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the same bits as int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def pack_gptq(q: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``q (K, N)`` and stored zeros ``z (NG, N)`` in [0, 15] -> ``qweight (K//8, N)``, ``qzeros (NG, N//8)``."""
    qweight = sum(q[i::8].long() << (4 * i) for i in range(8))
    qzeros = sum(z[:, i::8].long() << (4 * i) for i in range(8))
    return _int32(qweight), _int32(qzeros)


def pack_awq(q: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``q (K, N)``, zeros ``z (NG, N)`` -> ``qweight (K, N//8)``, ``qzeros (NG, N//8)`` in the AWQ order."""
    qweight = sum(q[:, AWQ_ORDER[i]::8].long() << (4 * i) for i in range(8))
    qzeros = sum(z[:, AWQ_ORDER[i]::8].long() << (4 * i) for i in range(8))
    return _int32(qweight), _int32(qzeros)


def dequant_gptq(qweight, qzeros, scales, g_idx, v1: bool) -> torch.Tensor:
    """The GPTQ reader: ``W (N, K)`` float64 from the packed tensors."""
    k, n = torch.arange(8 * qweight.shape[0]), torch.arange(qweight.shape[1])
    q = (qweight.long()[k // 8] >> (4 * (k % 8))[:, None]) & 15  # (K, N)
    z = (qzeros.long()[:, n // 8] >> (4 * (n % 8))) & 15  # (NG, N)
    z = z + 1 if v1 else z
    return ((q - z[g_idx.long()]) * scales.double()[g_idx.long()]).t()


def dequant_awq(qweight, qzeros, scales, group: int) -> torch.Tensor:
    """The AWQ GEMM reader: ``W (N, K)`` float64 from the packed tensors."""
    n = torch.arange(8 * qweight.shape[1])
    shift = 4 * torch.tensor([AWQ_ORDER.index(c) for c in range(8)])[n % 8]
    q = (qweight.long()[:, n // 8] >> shift) & 15
    z = (qzeros.long()[:, n // 8] >> shift) & 15
    g = torch.arange(qweight.shape[0]) // group
    return ((q - z[g]) * scales.double()[g]).t()


def act_order_g_idx(k: int, group: int) -> torch.Tensor:
    """GPTQ ``desc_act``: features visited in a random order, group ``i // G`` for the ``i``-th visited one."""
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k)] = torch.arange(k, dtype=torch.int32) // group
    return g_idx


def quantize_gptq_style(w: torch.Tensor, g_idx: torch.Tensor, sym: bool):
    """``w (N, K)`` -> codes ``q (K, N)``, zero points ``z (NG, N)``, fp16 ``scales (NG, N)`` (per-group min/max)."""
    num_groups = int(g_idx.max()) + 1
    members = [g_idx == g for g in range(num_groups)]
    lo = torch.stack([w[:, m].amin(1) for m in members], 1).clamp_max(0)  # (N, NG)
    hi = torch.stack([w[:, m].amax(1) for m in members], 1).clamp_min(0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    scales = ((hi - lo) / 15).clamp_min(1e-6).half()
    z = torch.full_like(lo, 8) if sym else torch.round(-lo / scales.float()).clamp(0, 15)
    gi = g_idx.long()
    q = torch.round(w / scales.float()[:, gi] + z[:, gi]).clamp(0, 15)
    return q.t().to(torch.uint8), z.t().to(torch.uint8), scales.t().contiguous()


def gptq_tensors(w, group, sym, act_order, v1, g_idx=None):
    """Quantize ``w (N, K)`` and pack it GPTQ-style: ``(qweight, qzeros, scales, g_idx, W_ref (N, K) float64)``."""
    k = w.shape[1]
    if g_idx is None:
        g_idx = act_order_g_idx(k, group) if act_order else torch.arange(k, dtype=torch.int32) // group
    q, z, scales = quantize_gptq_style(w, g_idx, sym)
    qweight, qzeros = pack_gptq(q, (z.long() - 1) & 15 if v1 else z)
    return qweight, qzeros, scales, g_idx, dequant_gptq(qweight, qzeros, scales, g_idx, v1)


def awq_tensors(w, group):
    """Quantize ``w (N, K)`` and pack it AWQ-style: ``(qweight, qzeros, scales, W_ref (N, K) float64)``."""
    g_idx = torch.arange(w.shape[1], dtype=torch.int32) // group
    q, z, scales = quantize_gptq_style(w, g_idx, sym=False)
    qweight, qzeros = pack_awq(q, z)
    return qweight, qzeros, scales, dequant_awq(qweight, qzeros, scales, group)


def test_packers_match_known_words():
    codes = torch.arange(8, dtype=torch.uint8)
    qweight, qzeros = pack_gptq(codes[:, None], torch.full((1, 8), 7, dtype=torch.uint8))
    assert qweight.item() == 0x76543210 and qzeros.item() == 0x77777777  # symmetric v1: zero 8 stored as 7
    qweight, _ = pack_awq(codes[None, :], codes[None, :])
    assert qweight.item() == 0x75316420  # value i is column AWQ_ORDER[i]
    top = pack_gptq(torch.full((8, 1), 15, dtype=torch.uint8), torch.zeros(1, 8, dtype=torch.uint8))[0]
    assert top.item() == -1 and top.dtype == torch.int32


@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_linear_is_exact(v1, act_order, sym, group):
    k, n = 512, 24  # group -1: one group of 512 becomes two llmplug groups of 256
    qweight, qzeros, scales, g_idx, w_ref = gptq_tensors(torch.randn(n, k), k if group == -1 else group, sym,
                                                         act_order, v1)
    linear = gptq_linear(qweight, qzeros, scales, g_idx, group_size=group,
                         checkpoint_format="gptq" if v1 else "gptq_v2", dtype=torch.float16)
    assert (linear.perm is not None) == (act_order and group != -1)
    assert linear.group_size == (256 if group == -1 else group)
    assert torch.equal(linear.dequantize(torch.float64), w_ref)


def test_gptq_v1_stored_15_reads_as_zero_16():
    """v1 stores ``zero - 1``; readers add one after masking, so a stored 15 (a zero point of 0 saved by
    AutoGPTQ's packer) reads as 16."""
    k, n, group = 64, 16, 32
    q = torch.randint(0, 16, (k, n), dtype=torch.uint8)
    stored = torch.randint(0, 16, (k // group, n), dtype=torch.uint8)
    stored[0, :3] = 15
    qweight, qzeros = pack_gptq(q, stored)
    scales = torch.rand(k // group, n).half() + 0.1
    g_idx = torch.arange(k, dtype=torch.int32) // group
    linear = gptq_linear(qweight, qzeros, scales, g_idx, group_size=group, dtype=torch.float32)
    assert linear.zeros[:3, 0].tolist() == [16.0] * 3
    assert torch.equal(linear.dequantize(torch.float64), dequant_gptq(qweight, qzeros, scales, g_idx, v1=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [32, 64, -1])
def test_awq_linear_is_exact(group, dtype):
    k, n = 128, 40
    qweight, qzeros, scales, w_ref = awq_tensors(torch.randn(n, k), k if group == -1 else group)
    linear = awq_linear(qweight, qzeros, scales, group_size=group, dtype=dtype)
    assert linear.perm is None
    assert torch.equal(linear.dequantize(torch.float64), w_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("fmt", ["gptq_act_order", "awq"])
def test_matmul_matches_dequantised_reference(fmt, m, dtype):
    """The repacked module's kernels (interpreted Triton) against ``x @ W^T`` with the source's fp32 weight."""
    k, n, group = 128, 40, 32
    w, bias = torch.randn(n, k), torch.randn(n)
    if fmt == "awq":
        qweight, qzeros, scales, w_ref = awq_tensors(w, group)
        linear = awq_linear(qweight, qzeros, scales, bias, group_size=group, dtype=dtype)
    else:
        qweight, qzeros, scales, g_idx, w_ref = gptq_tensors(w, group, sym=False, act_order=True, v1=True)
        linear = gptq_linear(qweight, qzeros, scales, g_idx, bias, group_size=group, dtype=dtype)
    x = torch.randn(3, m, k)
    ref = x.double() @ w_ref.t() + bias.double()
    with cpu_kernels(True):
        out = linear(x.to(dtype))
    assert out.dtype == dtype and out.shape == (3, m, n)
    assert sqnr_db(ref, out) > 40
    xs = torch.randn(m, k)  # the rows as a fused gate/up projection: act(gate) * up through the permuted input
    y = xs.double() @ w_ref.t() + bias.double()
    expected = torch.nn.functional.silu(y[:, :n // 2]) * y[:, n // 2:]
    with cpu_kernels(True):
        assert sqnr_db(expected, linear.gated_matmul(xs.to(dtype), "silu")) > 40


def test_bad_tensors_are_rejected():
    k, n = 64, 16
    qweight, qzeros, scales, g_idx, _ = gptq_tensors(torch.randn(n, k), 32, False, True, True)
    uneven = g_idx.clone()
    uneven[uneven == 0] = 1
    uneven[0] = 0
    with pytest.raises(ValueError, match="every group 32"):
        gptq_linear(qweight, qzeros, scales, uneven, group_size=32)
    with pytest.raises(ValueError, match="checkpoint_format='marlin'"):
        gptq_linear(qweight, qzeros, scales, g_idx, group_size=32, checkpoint_format="marlin")
    q16 = gptq_tensors(torch.randn(n, k), 16, False, False, True)
    with pytest.raises(ValueError, match="groups of 16 input features are not supported"):
        gptq_linear(*q16[:4], group_size=16)
    with pytest.raises(ValueError, match="scales must be"):
        gptq_linear(qweight, qzeros, scales[:, :8], g_idx, group_size=32)
    with pytest.raises(ValueError, match="int32"):
        gptq_linear(qweight.long(), qzeros, scales, g_idx, group_size=32)


def test_fusing_different_input_orders_is_refused():
    k, n, group = 64, 16, 32
    mods = [gptq_linear(*gptq_tensors(torch.randn(n, k), group, False, True, True)[:4], group_size=group)
            for _ in range(2)]
    with pytest.raises(NotImplementedError, match="permuted differently"):
        fuse_quant_linears(mods, UndoLog())
    mods[1].perm = mods[0].perm
    fused = fuse_quant_linears(mods, UndoLog())
    assert fused.perm is mods[0].perm and fused.qweight.shape == (2 * n, k // 2)


# ---- whole checkpoints ---------------------------------------------------------------------------------------------

INPUTS = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp", "up_proj": "mlp",
          "down_proj": "down"}  # linears reading the same input share GPTQ's act-order g_idx


def write_checkpoint(path, model, method: str, group: int = 32, sym: bool = False, act_order: bool = False,
                     v1: bool = True, autogptq_file: bool = False) -> dict[str, torch.Tensor]:
    """Save ``model`` (fp32) as a GPTQ / AWQ checkpoint under ``path``; returns the dequantised weights by name.

    ``autogptq_file``: the settings go to AutoGPTQ's ``quantize_config.json`` instead of ``config.json``."""
    tensors, weights, g_idx = {}, {}, {}
    for prefix, linear in model.named_modules():
        name = prefix.rpartition(".")[2]
        if name not in INPUTS:
            continue
        shared = (prefix.rsplit(".", 2)[0], INPUTS[name])  # (layer, input)
        w = linear.weight.detach()
        g = w.shape[1] if group == -1 else group  # -1: one group over K
        if method == "awq":
            qweight, qzeros, scales, w_ref = awq_tensors(w, g)
            tensors.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales})
        else:
            if shared not in g_idx:
                g_idx[shared] = act_order_g_idx(w.shape[1], g) if act_order else \
                    torch.arange(w.shape[1], dtype=torch.int32) // g
            qweight, qzeros, scales, gi, w_ref = gptq_tensors(w, g, sym, act_order, v1, g_idx[shared])
            tensors.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales,
                            f"{prefix}.g_idx": gi.clone()})
        weights[f"{prefix}.weight"] = w_ref
    tied = model.config.get_text_config().tie_word_embeddings
    for key, value in model.state_dict().items():
        if key not in weights and not (tied and key == "lm_head.weight"):
            tensors[key] = value.contiguous()
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    qc.update({"version": "gemm", "zero_point": True} if method == "awq" else
              {"desc_act": act_order, "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"})
    if autogptq_file:
        del qc["quant_method"]
        (path / "quantize_config.json").write_text(json.dumps(qc))
        model.config.save_pretrained(path)
    else:
        model.config.quantization_config = qc
        model.config.save_pretrained(path)
        del model.config.quantization_config
    save_file(tensors, str(path / "model.safetensors"))
    return weights


def reference_model(model, weights, dtype, family="llama"):
    """``model`` with every quantized linear's weight replaced by its dequantised source weight, in ``dtype``."""
    state = {k: (weights[k] if k in weights else v).to(dtype) for k, v in model.state_dict().items()}
    ref = make_model(family, dtype)
    ref.load_state_dict(state)
    return ref


CHECKPOINTS = {
    "gptq_v1_act_order": dict(method="gptq", act_order=True, v1=True),
    "gptq_v2_sym_act_order": dict(method="gptq", sym=True, act_order=True, v1=False),
    "gptq_v1_sym_autogptq_file": dict(method="gptq", sym=True, autogptq_file=True),
    "gptq_v2_per_channel": dict(method="gptq", group=-1, v1=False),  # K = 64, 96: llmplug groups of 32
    "awq": dict(method="awq"),
}


@pytest.mark.parametrize("kind", sorted(CHECKPOINTS))
def test_model_logits_match_dequantised_reference_fp32(tmp_path, kind):
    """Interpreted kernels for one checkpoint, the ``w4_linear`` reference for the others (faster)."""
    model = make_model("llama")
    weights = write_checkpoint(tmp_path, model, **CHECKPOINTS[kind])
    imported = llmplug.from_gptq_awq(tmp_path, dtype=torch.float32)
    quantized = [n for n, m in imported.named_modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 14 and not imported.training
    assert any(m.perm is not None for m in imported.modules() if isinstance(m, QuantLinear)) == \
        CHECKPOINTS[kind].get("act_order", False)
    assert not hasattr(imported.config, "quantization_config")
    assert imported._llmplug_quantization["group_size"] == 32
    ids, mask = pad(prompts(3))
    expected = reference_model(model, weights, torch.float32)(input_ids=ids, attention_mask=mask).logits
    with cpu_kernels(kind == "gptq_v1_act_order"):
        got = imported(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_biases_and_tied_embeddings(tmp_path, family):
    """Qwen2's q/k/v biases load into the quantized linears; Gemma's lm_head is tied to the (loaded) embedding."""
    model = make_model(family)
    weights = write_checkpoint(tmp_path, model, method="gptq", act_order=True)
    imported = llmplug.from_gptq_awq(tmp_path, dtype=torch.float32)
    attn = imported.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None) == (family == "qwen2")
    if family == "gemma":
        assert imported.lm_head.weight is imported.model.embed_tokens.weight
    ids, mask = pad(prompts(3))
    expected = reference_model(model, weights, torch.float32, family)(input_ids=ids, attention_mask=mask).logits
    with cpu_kernels(False):
        got = imported(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["gptq_v1_act_order", "awq"])
def test_model_logits_bf16_within_tolerance(tmp_path, kind):
    model = make_model("llama")
    weights = write_checkpoint(tmp_path, model, **CHECKPOINTS[kind])
    imported = llmplug.from_gptq_awq(tmp_path, dtype=torch.bfloat16)
    ids, mask = pad(prompts(3))
    ref64 = reference_model(model, weights, torch.float64)(input_ids=ids, attention_mask=mask).logits
    stock = reference_model(model, weights, torch.bfloat16)(input_ids=ids, attention_mask=mask).logits
    with cpu_kernels(True):
        got = imported(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == torch.bfloat16
    keep = mask.bool()  # padded positions carry no meaning
    assert_close_matmul_like(got[keep], ref64[keep], stock[keep])


def test_optimized_generate_matches_stock(tmp_path):
    write_checkpoint(tmp_path, make_model("llama"), method="gptq", act_order=True)
    model = llmplug.from_gptq_awq(tmp_path, dtype=torch.float32)
    ids, mask = pad(prompts(4, lengths=(5, 13, 2, 8)))
    with cpu_kernels(False):
        expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    llmplug.optimize(model)
    layer = state_of(model).runner.forward_fn.layers[0]
    assert layer.qkv.perm is not None and layer.gate_up.perm is not None
    with cpu_kernels(False):
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)
    assert len(set(got[:, ids.shape[1]:].flatten().tolist())) > 3, "degenerate model output: test cannot fail"


@pytest.mark.parametrize("change, message", [
    ({"bits": 8}, "bits=8 is not supported"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format='marlin' is not supported"),
    ({"is_marlin_format": True}, "checkpoint_format='marlin' is not supported"),
    ({"quant_method": "awq", "version": "gemv"}, "version='gemv' is not supported"),
    ({"quant_method": "awq", "version": "GEMM", "zero_point": False}, "zero_point=False"),
])
def test_unsupported_configs_are_named(tmp_path, change, message):
    make_model("llama").config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        llmplug.from_gptq_awq(tmp_path)
