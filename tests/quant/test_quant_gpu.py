"""Quantized kernels and models on the GPU at full size (run through the device tool)."""

import pytest
import torch

import llmplug
from llmplug.ops.fp8_linear import fp8_linear, fp8_linear_ref
from llmplug.ops.w4_linear import DENSE_MIN_TOKENS, w4_dequantize, w4_linear, w4_linear_ref
from llmplug.ops.w8_linear import DENSE_MIN_TOKENS as W8_DENSE_MIN_TOKENS
from llmplug.ops.w8_linear import w8_dequantize, w8_linear, w8_linear_ref
from llmplug.quant.formats import dequantize_int4, quantize_fp8, quantize_int4, quantize_int8, sqnr_db
from tests.tiny_models import make_model, pad, prompts
from tests.tolerances import KERNEL_VS_REF_SQNR_DB, QUANT_SQNR_DB

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,k", [(28672, 4096), (16384, 2048), (38, 4100)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_gemvs_equal_product_then_act_and_mul(n, k, activation):
    """The one-token GEMVs' gated epilogue gives act_and_mul of their plain output, bit for bit (bf16, int8, fp8)."""
    from llmplug.ops.act_mul import act_and_mul
    from llmplug.ops.gemv import gemv

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(gemv(x, w, gated=activation), act_and_mul(gemv(x, w), activation))
    for q in (quantize_int8(w), quantize_fp8(w)):
        assert torch.equal(w8_linear(x, *q, gated=activation), act_and_mul(w8_linear(x, *q), activation))
    if k % 128 == 0:  # int4 in groups of 128
        q4 = quantize_int4(w, 128)
        assert torch.equal(w4_linear(x, *q4, 128, gated=activation), act_and_mul(w4_linear(x, *q4, 128), activation))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8_gemv_decodes_every_e4m3_value_exactly(dtype):
    """Compiled, the one-token fp8 GEMV keeps every finite e4m3 value exact, subnormals included (no flush to zero),
    in every byte position of a word; bf16 activations take the int64 reads."""
    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    codes = codes[(codes & 0x7F) != 0x7F]
    q = codes[:, None].repeat(1, 4096).view(torch.float8_e4m3fn)
    s = torch.rand(codes.numel(), device="cuda") + 0.5
    for i in (0, 1, 2, 3, 2049, 4095):
        x = torch.zeros(1, 4096, device="cuda", dtype=dtype)
        x[0, i] = 1.0
        assert torch.equal(w8_linear(x, q, s)[0], (q[:, i].float() * s).to(dtype)), i


@pytest.mark.parametrize("m", [1, 3, 16, 64, 300, DENSE_MIN_TOKENS + 5, W8_DENSE_MIN_TOKENS + 3])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_kernels_at_8b_shapes(m, n, k):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    exact = x.double() @ w.double().t()
    q8 = quantize_int8(w)
    out = w8_linear(x, *q8)
    assert sqnr_db(w8_linear_ref(x, *q8), out) >= KERNEL_VS_REF_SQNR_DB
    assert sqnr_db(exact, out) >= QUANT_SQNR_DB["int8"]
    q4 = quantize_int4(w, 128)
    out = w4_linear(x, *q4, 128)
    assert sqnr_db(w4_linear_ref(x, *q4, 128), out) >= KERNEL_VS_REF_SQNR_DB
    assert sqnr_db(exact, out) >= QUANT_SQNR_DB["int4"]
    qf = quantize_fp8(w)
    out = w8_linear(x, *qf)
    assert sqnr_db(w8_linear_ref(x, *qf), out) >= KERNEL_VS_REF_SQNR_DB
    if torch.cuda.get_device_capability() >= (8, 9):
        out = fp8_linear(x, *qf)
        assert sqnr_db(fp8_linear_ref(x, *qf), out) >= KERNEL_VS_REF_SQNR_DB
        assert sqnr_db(exact, out) >= QUANT_SQNR_DB["fp8"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_prefill_dequantises_for_cublas(dtype):
    """From DENSE_MIN_TOKENS rows on: the Triton dequantisation equals the reference bit for bit, and the product is
    cuBLAS's on that weight."""
    q, s, z = quantize_int4(torch.randn(6168, 4096, device="cuda", dtype=dtype) * 0.02, 128)
    s, z = s.to(dtype), z.to(dtype)
    w = dequantize_int4(q, s, z, 128, dtype)
    assert torch.equal(w4_dequantize(q, s, z, 128, dtype), w)
    x = torch.randn(DENSE_MIN_TOKENS + 7, 4096, device="cuda", dtype=dtype)
    assert torch.equal(w4_linear(x, q, s, z, 128), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_w8_prefill_dequantises_for_cublas(method):
    q, s = (quantize_int8 if method == "int8" else quantize_fp8)(
        torch.randn(6168, 4096, device="cuda", dtype=torch.bfloat16) * 0.02)
    w = (q.float() * s[:, None]).to(torch.bfloat16)
    assert torch.equal(w8_dequantize(q, s, torch.bfloat16), w)
    x = torch.randn(W8_DENSE_MIN_TOKENS + 7, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(w8_linear(x, q, s), torch.nn.functional.linear(x, w))


def _int4(n, k, dtype, group_size):
    w = torch.randn(n, k, device="cuda") * 0.02
    return [t.to(dtype) if t.is_floating_point() else t for t in quantize_int4(w, group_size)]


@pytest.mark.parametrize("m", [1, 5, 64, 130])
@pytest.mark.parametrize("n,k", [(28672, 4096), (4096, 14336), (6168, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 128, 256])
def test_int4_packed_dequantisation(m, n, k, dtype, group_size):
    """The packed 16-bit kernels -- the GEMM's bf16x2 / f16x2 dequantisation, the one-token GEMV's bf16x2 products
    (fp16's GEMV multiplies in fp32) -- match the fp32 reference (a ragged last tile of rows)."""
    q4 = _int4(n, k, dtype, group_size)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    assert sqnr_db(w4_linear_ref(x, *q4, group_size), w4_linear(x, *q4, group_size)) >= KERNEL_VS_REF_SQNR_DB


@pytest.mark.parametrize("offset,stride", [(0, 4096), (0, 4098), (1, 4100), (2, 4100)])
def test_int4_gemv_reads_unaligned_activations(offset, stride):
    """The packed bf16 GEMV reads x four values an int64; other row strides or alignments take the fp32 GEMV."""
    q4 = _int4(6168, 4096, torch.bfloat16, 128)
    x = torch.randn(stride + offset, device="cuda", dtype=torch.bfloat16)[offset:offset + 4096].view(1, 4096)
    x = x.as_strided((1, 4096), (stride, 1))
    want = w4_linear_ref(x, *q4, 128)
    assert sqnr_db(want, w4_linear(x, *q4, 128)) >= KERNEL_VS_REF_SQNR_DB


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_packed_dequantisation_rounds_once(dtype, group_size):
    """The weights the packed GEMM multiplies are the reference's, rounded once: rows of the identity read W's first
    columns back bit for bit."""
    n, k = 6168, 4096
    q4 = _int4(n, k, dtype, group_size)
    eye = torch.eye(k, device="cuda", dtype=dtype)[:130]
    got = w4_linear(eye, *q4, group_size).t()
    assert torch.equal(got, dequantize_int4(*q4, group_size, torch.float32)[:, :130].to(dtype))


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_model_graphs_match_eager(method):
    """Decode under CUDA graphs gives the tokens the eager path gives, for a quantized bf16 model."""
    model = make_model("llama", dtype=torch.bfloat16).cuda()
    ids, mask = pad(prompts(3))
    ids, mask = ids.cuda(), mask.cuda()
    llmplug.optimize(model, quantize=method, group_size=32, cuda_graphs=False)
    eager = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    llmplug.unoptimize(model)
    llmplug.optimize(model, quantize=method, group_size=32)
    graphs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(graphs, eager)
