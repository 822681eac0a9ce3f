import pytest
import torch

from llmplug.ops.gemv import add_norm_gemv, add_norm_gemv_ref, gemv, gemv_group, gemv_group_ref, gemv_ref
from llmplug.ops.rms_norm import add_rms_norm_ref
from tests.tolerances import assert_close_matmul_like


@pytest.mark.parametrize("n,k", [(1, 64), (19, 80), (99, 200), (64, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(n, k, dtype, bias):
    x = torch.randn(1, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    out = gemv(x, w, b, config=(8, 64, 4, 2))
    assert out.shape == (1, n)
    ref64 = gemv_ref(x.double(), w.double(), b.double() if bias else None)
    same = (x.float() @ w.float().T + (b.float() if bias else 0)).to(dtype)
    assert_close_matmul_like(out, ref64, same)


@pytest.mark.parametrize("gated", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("n", [2, 38, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_output(gated, n, dtype, bias):
    """Gate rows then up rows: act(gate) * up in the epilogue, each half rounded as the plain product would be."""
    x = torch.randn(1, 80, dtype=dtype)
    w = torch.randn(n, 80, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    out = gemv(x, w, b, gated=gated, config=(8, 32, 4, 2))
    assert out.shape == (1, n // 2)
    ref64 = gemv_ref(x.double(), w.double(), b.double() if bias else None, gated=gated)
    same = gemv_ref(x, w, b, gated=gated)
    assert_close_matmul_like(out, ref64, same)


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_out_is_the_unrounded_product(bias):
    """``fp32_out``: a bf16 product (a row-parallel rank's share) comes back in fp32, not rounded to bf16."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 200, generator=g).to(torch.bfloat16)
    w = torch.randn(99, 200, generator=g).to(torch.bfloat16)
    b = torch.randn(99, generator=g).to(torch.bfloat16) if bias else None
    out = gemv(x, w, b, config=(8, 64, 4, 2), fp32_out=True)
    assert out.dtype == torch.float32 and out.shape == (1, 99)
    exact = gemv_ref(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)  # fp32 sums, not bf16's 2^-8
    assert not torch.equal(out, out.to(torch.bfloat16).float())  # really unrounded
    with pytest.raises(ValueError, match="fp32_out"):
        gemv(x, torch.randn(8, 200).to(torch.bfloat16), gated="silu", fp32_out=True)


def test_row_view_of_fused_weight():
    fused = torch.randn(48, 96)
    w = fused[16:40]
    x = torch.randn(1, 96)
    torch.testing.assert_close(gemv(x, w, config=(8, 32, 4, 2)), gemv_ref(x, w))


@pytest.mark.parametrize("k", [64, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset,round_first", [(0.0, None), (1.0, None), (0.0, False)])  # Llama, Gemma, OLMo 2
@pytest.mark.parametrize("gated", ["", "silu"])
def test_add_norm_prologue(k, dtype, offset, round_first, gated):
    """The residual add + RMSNorm in the prologue: the same new residual, the product of the normalised input."""
    x, residual = torch.randn(1, k, dtype=dtype), torch.randn(1, k, dtype=dtype)
    norm_w = torch.rand(k, dtype=dtype) + 0.5
    w, b = torch.randn(38, k, dtype=dtype), torch.randn(38, dtype=dtype)
    y, res = add_norm_gemv(x, residual, norm_w, 1e-6, offset, w, b, config=(8, 64, 4, 2), gated=gated,
                           round_first=round_first)
    normed, res_ref = add_rms_norm_ref(x, residual, norm_w, 1e-6, offset, round_first)
    assert torch.equal(res, res_ref)
    assert y.shape == (1, 19 if gated else 38)
    ref64 = gemv_ref(normed.double(), w.double(), b.double(), gated)
    same, _ = add_norm_gemv_ref(x, residual, norm_w, 1e-6, offset, w, b, gated, round_first)
    assert_close_matmul_like(y, ref64, same)
    # the normalised input itself, through an identity weight: add_rms_norm's values (its rsqrt may differ by an ulp)
    eye = torch.eye(k, dtype=dtype)
    x_in, _ = add_norm_gemv(x, residual, norm_w, 1e-6, offset, eye, config=(8, 64, 4, 2), round_first=round_first)
    torch.testing.assert_close(x_in, normed, rtol=0 if dtype == torch.float32 else 8e-3, atol=1e-6)


@pytest.mark.parametrize("rows", [(19, 7, 7), (40, 8), (1, 3, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_is_the_gemv_of_the_stacked_weights(rows, dtype):
    """Two or three weights read where they lie: bit for bit the GEMV of their concatenation (same config), and
    close to the separate products."""
    x = torch.randn(1, 80, dtype=dtype)
    weights = [torch.randn(n, 80, dtype=dtype) for n in rows]
    out = gemv_group(x, weights, config=(8, 32, 4, 2))
    assert out.shape == (1, sum(rows))
    assert torch.equal(out, gemv(x, torch.cat(weights), config=(8, 32, 4, 2)))
    ref64, _ = gemv_group_ref(x.double(), [w.double() for w in weights])
    assert_close_matmul_like(out, ref64, gemv_group_ref(x, weights)[0])


@pytest.mark.parametrize("gated", ["silu", "gelu_tanh"])
def test_group_gated_from_separate_gate_and_up(gated):
    x = torch.randn(1, 80, dtype=torch.bfloat16)
    gate, up = torch.randn(38, 80, dtype=torch.bfloat16), torch.randn(38, 80, dtype=torch.bfloat16)
    out = gemv_group(x, [gate, up], gated=gated, config=(8, 32, 4, 2))
    assert torch.equal(out, gemv(x, torch.cat([gate, up]), gated=gated, config=(8, 32, 4, 2)))


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_group_with_the_norm_prologue(offset):
    x, residual = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16)
    norm_w = torch.rand(64, dtype=torch.bfloat16) + 0.5
    fused = torch.randn(30, 64, dtype=torch.bfloat16)  # row views of one tensor: one row stride
    weights = [fused[:16], fused[16:23], fused[23:]]
    y, res = gemv_group(x, weights, norm=(residual, norm_w, 1e-6, offset, None), config=(8, 64, 4, 2))
    want_y, want_res = add_norm_gemv(x, residual, norm_w, 1e-6, offset, fused, config=(8, 64, 4, 2))
    assert torch.equal(y, want_y) and torch.equal(res, want_res)


def test_group_bad_input():
    x = torch.randn(1, 8)
    with pytest.raises(ValueError, match="two or three weights, got 1"):
        gemv_group(x, [torch.randn(4, 8)])
    with pytest.raises(ValueError, match="share K"):
        gemv_group(x, [torch.randn(4, 8), torch.randn(4, 9)])
    with pytest.raises(ValueError, match="gated='silu' needs two weights of one shape"):
        gemv_group(x, [torch.randn(4, 8), torch.randn(2, 8)], gated="silu")
    with pytest.raises(ValueError, match="norm"):
        gemv_group(x, [torch.randn(4, 8), torch.randn(4, 8)], norm=(x, torch.ones(7), 1e-6, 0.0, None))


def test_bad_input():
    with pytest.raises(ValueError, match=r"\(1, 8\)"):
        gemv(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="relu"):
        gemv(torch.randn(1, 8), torch.randn(4, 8), gated="relu")
    with pytest.raises(ValueError, match="even"):
        gemv(torch.randn(1, 8), torch.randn(5, 8), gated="silu")
    x = torch.randn(1, 8)
    with pytest.raises(ValueError, match="residual"):
        add_norm_gemv(x, torch.randn(1, 8, dtype=torch.float16), torch.ones(8), 1e-6, 0.0, torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"norm_weight.shape=\(7,\)"):
        add_norm_gemv(x, x, torch.ones(7), 1e-6, 0.0, torch.randn(4, 8))


def test_opcheck():
    args = (torch.randn(1, 32), torch.randn(16, 32), None, "", 8, 32, 4, 2, False)
    torch.library.opcheck(torch.ops.llmplug.gemv.default, args)
    torch.library.opcheck(torch.ops.llmplug.gemv.default, (*args[:3], "silu", *args[4:]))
    torch.library.opcheck(torch.ops.llmplug.gemv.default, (*args[:-1], True))
    x = torch.randn(1, 32)
    norm_args = (x, torch.randn(1, 32), torch.rand(32), 1e-6, 0.0, True, torch.randn(16, 32), None, "silu", 8, 32, 4,
                 2)
    torch.library.opcheck(torch.ops.llmplug.add_norm_gemv.default, norm_args)
    weights = [torch.randn(16, 32), torch.randn(16, 32)]
    group_args = (x, weights, None, None, 0.0, 0.0, True, "silu", 8, 32, 4, 2)
    torch.library.opcheck(torch.ops.llmplug.gemv_group.default, group_args)
    torch.library.opcheck(torch.ops.llmplug.gemv_group.default, (x, weights, torch.randn(1, 32), torch.rand(32), 1e-6,
                                                                  1.0, False, "", 8, 32, 4, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("shapes,gated,norm", [([6144 - 2048, 1024, 1024], "", True), ([14336, 14336], "silu", False),
                                               ([2048, 512, 512], "", False)])
def test_group_cuda_bf16_is_the_stacked_gemv(shapes, gated, norm):
    """On the GPU (compiled kernel, programmatic launch on Hopper): the group over separate q/k/v or gate/up weights is
    bit for bit the GEMV of their concatenation, with the norm prologue too."""
    from llmplug.ops._triton import programmatic_launch

    k = 4096 if shapes[0] > 2048 else 2048
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n in shapes]
    stacked = torch.cat(weights)
    with programmatic_launch():
        if norm:
            residual, norm_w = torch.randn_like(x), torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
            y, res = gemv_group(x, weights, norm=(residual, norm_w, 1e-5, 0.0, None))
            want_y, want_res = add_norm_gemv(x, residual, norm_w, 1e-5, 0.0, stacked)
            assert torch.equal(res, want_res)
        else:
            y, want_y = gemv_group(x, weights, gated=gated), gemv(x, stacked, gated=gated)
    torch.cuda.synchronize()
    assert torch.equal(y, want_y)
