import pytest
import torch

from llmplug.ops.act_mul import act_and_mul, act_and_mul_ref, act_mul, act_mul_ref
from tests.tolerances import assert_close_elementwise

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("rows", [1, 19, 99])
@pytest.mark.parametrize("n", [64, 80, 200])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_matches_reference(rows, n, dtype, activation):
    gu = torch.randn(rows, 2 * n, dtype=dtype) * 3
    out = act_and_mul(gu, activation)
    assert_close_elementwise(out, act_and_mul_ref(gu, activation))


def test_reference_matches_torch_definition():
    gu = torch.randn(7, 32, dtype=torch.float64)
    gate, up = gu.chunk(2, -1)
    expected = torch.nn.functional.silu(gate) * up
    assert torch.allclose(act_and_mul_ref(gu, "silu"), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounds_where_hf_rounds(dtype):
    """HF's MLP in a 16-bit dtype rounds act(gate) before multiplying by up: the reference does too, bit for bit."""
    gu = (torch.randn(9, 256) * 3).to(dtype)
    gate, up = gu.chunk(2, -1)
    assert torch.equal(act_and_mul_ref(gu, "silu"), torch.nn.functional.silu(gate) * up)
    assert torch.equal(act_and_mul_ref(gu, "gelu_tanh"), torch.nn.functional.gelu(gate, approximate="tanh") * up)


def test_leading_dims_and_bad_activation():
    gu = torch.randn(2, 3, 16)
    assert act_and_mul(gu).shape == (2, 3, 8)
    with pytest.raises(ValueError, match="relu"):
        act_and_mul(gu, "relu")


def test_opcheck():
    gu = torch.randn(5, 32)
    torch.library.opcheck(torch.ops.llmplug.act_mul.default, (gu[:, :16], gu[:, 16:], "silu"))
    torch.library.opcheck(torch.ops.llmplug.act_mul.default, (torch.randn(5, 16), torch.randn(5, 16), "gelu_tanh"))


def test_compiles():
    fn = torch.compile(lambda x: act_and_mul(x, "silu") * 2, fullgraph=True)
    gu = torch.randn(3, 8)
    assert_close_elementwise(fn(gu), act_and_mul_ref(gu, "silu") * 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_two_tensors(dtype, activation):
    """``act_mul(gate, up)`` on separate tensors (a compiled HF graph's two projections), leading dims and a strided
    view included: the fused op's values."""
    gate, up = (torch.randn(2, 7, 48, dtype=dtype) * 3 for _ in range(2))
    out = act_mul(gate, up, activation)
    assert out.shape == (2, 7, 48)
    assert_close_elementwise(out, act_and_mul_ref(torch.cat([gate, up], -1), activation))
    wide = torch.randn(7, 96, dtype=dtype)
    assert_close_elementwise(act_mul(wide[:, ::2], wide[:, 1::2], activation),
                             act_mul_ref(wide[:, ::2], wide[:, 1::2], activation))
    with pytest.raises(ValueError, match="must match"):
        act_mul(gate, up[..., :8])
