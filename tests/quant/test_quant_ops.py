"""The quantized matmul kernels (under the Triton interpreter on CPU) against their references and fp32."""

import pytest
import torch

from llmplug.ops._qmm import choose_split_k
from llmplug.ops.act_mul import act_and_mul_ref
from llmplug.ops.fp8_linear import fp8_linear, fp8_linear_ref, quantize_rows_fp8, quantize_rows_fp8_ref
from llmplug.ops.w4_linear import choose_config as w4_choose_config
from llmplug.ops.w4_linear import w4_dequantize, w4_linear, w4_linear_ref
from llmplug.ops.w8_linear import w8_dequantize, w8_linear, w8_linear_ref
from llmplug.quant.formats import (
    dequantize_int4,
    dequantize_rowwise,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    sqnr_db,
    unpack_int4,
)
from tests.tolerances import KERNEL_VS_REF_SQNR_DB, QUANT_SQNR_DB

SHAPES = [(1, 19, 256), (3, 33, 512), (19, 40, 256), (70, 17, 256)]  # (M, N, K): GEMV, split-K, GEMM
# one-token int8 reads int32 words: K past a whole number of steps, and K % 4 != 0 (the byte kernel)
W8_SHAPES = [*SHAPES, (1, 21, 1100), (1, 7, 90)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _exact(x, w, b):
    return x.double() @ w.double().t() + (b.double() if b is not None else 0)


@pytest.mark.parametrize("m,n,k", W8_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_w8_linear(m, n, k, dtype, method):
    w, x, b = torch.randn(n, k), torch.randn(m, k, dtype=dtype), torch.randn(n, dtype=dtype)
    q, s = (quantize_int8 if method == "int8" else quantize_fp8)(w)
    out = w8_linear(x, q, s, b)
    assert out.shape == (m, n) and out.dtype == dtype
    assert sqnr_db(w8_linear_ref(x, q, s, b), out) >= KERNEL_VS_REF_SQNR_DB
    assert sqnr_db(_exact(x, w, b), out) >= QUANT_SQNR_DB[method]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_w4_linear(m, n, k, dtype, group_size):
    w, x, b = torch.randn(n, k, dtype=dtype), torch.randn(m, k, dtype=dtype), torch.randn(n, dtype=dtype)
    q, s, z = quantize_int4(w, group_size)
    out = w4_linear(x, q, s, z, group_size, b)
    assert out.shape == (m, n) and out.dtype == dtype
    assert sqnr_db(w4_linear_ref(x, q, s, z, group_size, b), out) >= KERNEL_VS_REF_SQNR_DB
    assert sqnr_db(_exact(x, w, b), out) >= QUANT_SQNR_DB["int4"]


@pytest.mark.parametrize("m,n,k,group_size", [(1, 19, 1280, 64), (1, 21, 768, 256), (3, 21, 768, 256)])
def test_w4_linear_ragged_steps_and_group_256(m, n, k, group_size):
    """The GEMV over several steps with a ragged last one (20 groups, 16 a step), and 256-wide groups."""
    w, x = torch.randn(n, k), torch.randn(m, k, dtype=torch.bfloat16)
    q, s, z = quantize_int4(w, group_size)
    out = w4_linear(x, q, s, z, group_size)
    assert sqnr_db(w4_linear_ref(x, q, s, z, group_size), out) >= KERNEL_VS_REF_SQNR_DB
    assert sqnr_db(_exact(x, w, None), out) >= QUANT_SQNR_DB["int4"]


W4_CONFIGS = [(1, 2, 4, 4, 3, 1), (16, 16, 1, 4, 2, 1), (16, 16, 1, 4, 2, 4), (32, 32, 1, 4, 2, 0)]


@pytest.mark.parametrize("config", W4_CONFIGS)
def test_w4_configs(config):
    """Every kernel path (GEMV with several groups a step, GEMM with and without split-K) on one problem."""
    w, x = torch.randn(24, 512), torch.randn(5 if config[0] > 1 else 1, 512)
    q, s, z = quantize_int4(w, 64)
    torch.testing.assert_close(w4_linear(x, q, s, z, 64, config=config), w4_linear_ref(x, q, s, z, 64),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", [(1, 4, 64, 4, 3, 1), (16, 16, 32, 4, 2, 1), (16, 16, 32, 4, 2, 3)])
def test_w8_configs(config):
    w, x = torch.randn(24, 200), torch.randn(1 if config[0] == 1 else 7, 200)
    q, s = quantize_int8(w)
    torch.testing.assert_close(w8_linear(x, q, s, config=config), w8_linear_ref(x, q, s), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n,k,group_size", [(38, 256, 64), (22, 96, 32)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 5])
def test_w4_gated(n, k, group_size, activation, m):
    """int4 gated=act: one token in the GEMV's epilogue (a program's rows are gate rows and their up rows), else
    act_and_mul after the GEMM."""
    w, x = torch.randn(n, k), torch.randn(m, k, dtype=torch.bfloat16)
    q, s, z = quantize_int4(w, group_size)
    for bias in (None, torch.randn(n, dtype=x.dtype)):
        out = w4_linear(x, q, s, z, group_size, bias, gated=activation)
        assert out.shape == (m, n // 2) and out.dtype == x.dtype
        want = act_and_mul_ref(w4_linear_ref(x, q, s, z, group_size, bias), activation)
        assert sqnr_db(want, out) >= KERNEL_VS_REF_SQNR_DB
    with pytest.raises(ValueError, match="gated"):
        w4_linear(x, q, s, z, group_size, gated="relu")
    with pytest.raises(ValueError, match="even"):
        w4_linear(x, q[1:], s[1:], z[1:], group_size, gated=activation)


@pytest.mark.parametrize("n,k", [(38, 256), (22, 90), (40, 1100)])  # words (even tiles or not), bytes (K % 4)
@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 5])
def test_w8_gated(n, k, method, activation, m):
    """gated=act: act(gate) * up of a fused gate/up product; one token in the GEMV's epilogue, else after."""
    w, x = torch.randn(n, k), torch.randn(m, k, dtype=torch.bfloat16)
    q, s = (quantize_int8 if method == "int8" else quantize_fp8)(w)
    for bias in (None, torch.randn(n, dtype=x.dtype)):  # the bias is added before the gate
        out = w8_linear(x, q, s, bias, gated=activation)
        assert out.shape == (m, n // 2) and out.dtype == x.dtype
        want = act_and_mul_ref(w8_linear_ref(x, q, s, bias), activation)
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
        assert sqnr_db(want, out) >= KERNEL_VS_REF_SQNR_DB
    with pytest.raises(ValueError, match="gated"):
        w8_linear(x, q, s, gated="relu")
    with pytest.raises(ValueError, match="even"):
        w8_linear(x, q[1:], s[1:], gated=activation)


@pytest.mark.parametrize("k", [8, 12])  # whole steps of words, or not
def test_w8_gemv_decodes_every_e4m3_value_exactly(k):
    """The one-token fp8 GEMV decodes each byte with shifts and masks: every finite e4m3 value (zeros, subnormals,
    +-448), in every byte position of a word, comes out exact through one-hot activations."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # every code but the two NaNs: one a row
    q = codes[:, None].repeat(1, k).view(torch.float8_e4m3fn)
    s = torch.rand(codes.numel()) + 0.5
    for i in range(k):
        x = torch.zeros(1, k)
        x[0, i] = 1.0
        assert torch.equal(w8_linear(x, q, s)[0], q[:, i].float() * s), i


def test_weight_sqnr_on_llama_like_shapes():
    """The issue's bars on random Gaussian weights of an 8B-like width: int8 >= 35 dB, int4 g128 >= 18 dB."""
    w = torch.randn(256, 4096) * 0.02
    assert sqnr_db(w, dequantize_rowwise(*quantize_int8(w), torch.float32)) >= QUANT_SQNR_DB["int8"]
    assert sqnr_db(w, dequantize_int4(*quantize_int4(w, 128), 128, torch.float32)) >= QUANT_SQNR_DB["int4"]


def test_int4_packing_round_trip_and_layout():
    q = torch.randint(0, 16, (5, 128), dtype=torch.uint8)
    packed = pack_int4(q, 64)
    assert packed.shape == (5, 64) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, 64), q)
    # group g's byte j holds value j (low nibble) and value j + 32 (high nibble)
    assert torch.equal(packed[:, 0] & 15, q[:, 0]) and torch.equal(packed[:, 0] >> 4, q[:, 32])
    assert torch.equal(packed[:, 32] & 15, q[:, 64]) and torch.equal(packed[:, 32] >> 4, q[:, 96])


def test_int4_keeps_zero_exact():
    w = torch.randn(8, 64)
    w[:, ::3] = 0.0
    deq = dequantize_int4(*quantize_int4(w, 32), 32, torch.float32)
    assert torch.all(deq[:, ::3] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_fp8(dtype):
    """Scales exact; values: the interpreter's fp32 -> e4m3 cast is not the GPU's (it can land a binade low, e.g.
    124.3 -> 64, and rounds ties away from zero), so on CPU values are checked loosely, bit-exactly on the GPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(7, 300, dtype=dtype, device=device) * 3
    xq, xs = quantize_rows_fp8(x)
    rq, rs = quantize_rows_fp8_ref(x)
    torch.testing.assert_close(xs, rs)
    a, r = xq.float(), rq.float()
    if device == "cuda":
        assert torch.equal(a, r)
    else:
        assert torch.all((a.abs() >= r.abs() / 2 - 2.0**-9) & (a.abs() <= r.abs() * 1.125 + 2.0**-9) & (a * r >= 0))


def test_fp8_linear_reference_path():
    """Off sm 8.9+ GPUs fp8_linear runs the reference: activations rounded to fp8 per token, then the product."""
    w, x = torch.randn(32, 64), torch.randn(5, 64)
    q, s = quantize_fp8(w)
    torch.testing.assert_close(fp8_linear(x, q, s), fp8_linear_ref(x, q, s))
    assert sqnr_db(_exact(x, w, None), fp8_linear(x, q, s)) >= QUANT_SQNR_DB["fp8"]


def test_choose_split_k():
    assert choose_split_k(tiles=200, k_steps=64, sms=132) == 2
    assert choose_split_k(tiles=400, k_steps=64, sms=132) == 1
    assert choose_split_k(tiles=4, k_steps=8, sms=132) == 2  # keeps >= 4 K steps a split
    assert choose_split_k(tiles=1, k_steps=1024, sms=132) == 16


@pytest.mark.parametrize("x_bytes", [2, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_w4_gemm_config_fits_shared_memory(group_size, x_bytes):
    # an H100's opt-in limit; the GEMM's K step is one group, so wide groups used to ask for 312 KB (GPU failure)
    smem = 232448
    for m in (1, 16, 64, 130, 256, 300, 4096):
        block_m, block_n, _, _, stages, _ = w4_choose_config(m, 28672, 4096, group_size, x_bytes=x_bytes, smem=smem)
        if block_m > 1:
            stage = block_m * group_size * x_bytes + block_n * group_size // 2
            assert stage * stages <= smem - 32 * 1024, (m, group_size, x_bytes, block_m, stages)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, group_size", [(37, 256, 128), (5, 64, 32), (3, 512, 256)])
def test_w4_dequantize_matches_reference(n, k, group_size, dtype):
    w = torch.randn(n, k) * 0.05
    q, s, z = quantize_int4(w, group_size)
    s, z = s.to(dtype), z.to(dtype)
    got = w4_dequantize(q, s, z, group_size, dtype)
    assert got.dtype == dtype and torch.equal(got, dequantize_int4(q, s, z, group_size, dtype))


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8_dequantize_matches_reference(method, dtype):
    w = torch.randn(21, 300) * 0.05
    q, s = quantize_int8(w) if method == "int8" else quantize_fp8(w)
    assert torch.equal(w8_dequantize(q, s, dtype), (q.float() * s[:, None]).to(dtype))


def test_bad_input():
    q, s = quantize_int8(torch.randn(8, 32))
    with pytest.raises(ValueError, match="x must be"):
        w8_linear(torch.randn(2, 31), q, s)
    with pytest.raises(ValueError, match="qweight.dtype"):
        w8_linear(torch.randn(2, 32), q.float(), s)
    with pytest.raises(ValueError, match="scales must be"):
        w8_linear(torch.randn(2, 32), q, s[:4])
    q4, s4, z4 = quantize_int4(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match="group_size"):
        w4_linear(torch.randn(2, 64), q4, s4, z4, 48)
    with pytest.raises(ValueError, match="scales and zeros"):
        w4_linear(torch.randn(2, 64), q4, s4[:, :1], z4, 32)
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_int4(torch.randn(8, 48), 32)


def test_opcheck():
    q, s = quantize_int8(torch.randn(16, 64))
    x = torch.randn(3, 64)
    torch.library.opcheck(torch.ops.llmplug.w8_linear, (x, q, s, None, "", 16, 16, 32, 4, 2, 1))
    torch.library.opcheck(torch.ops.llmplug.w8_linear, (x[:1], q, s, None, "silu", 1, 4, 32, 4, 2, 1))
    q4, s4, z4 = quantize_int4(torch.randn(16, 64), 32)
    torch.library.opcheck(torch.ops.llmplug.w4_linear, (x, q4, s4, z4, 32, None, "", 16, 16, 1, 4, 2, 1))
