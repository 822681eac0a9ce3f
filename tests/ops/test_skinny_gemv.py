import pytest
import torch

from llmplug.ops._triton import cpu_kernels
from llmplug.ops.skinny_gemv import skinny_gemv, skinny_gemv_ref
from tests.tolerances import assert_close_matmul_like


@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k", [(19, 64), (96, 200), (64, 1030)])
@pytest.mark.parametrize("gated", ["", "silu"])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_reference(m, n, k, gated, bias):
    g = torch.Generator().manual_seed(m * n + k)
    n = n + n % 2 if gated else n
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    with cpu_kernels(True):
        got = skinny_gemv(x, w, b, gated, config=(16, 64, 4, 1))
    ref64 = skinny_gemv_ref(x.double(), w.double(), None if b is None else b.double(), gated)
    assert_close_matmul_like(got, ref64, skinny_gemv_ref(x, w, b, gated))


def test_bad_inputs_and_opcheck():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="1 <= M <= 8"):
        skinny_gemv(torch.zeros(9, 16), w)
    with pytest.raises(ValueError, match="dtype"):
        skinny_gemv(torch.zeros(2, 16, dtype=torch.bfloat16), w)
    for fp32_out in (False, True):
        torch.library.opcheck(torch.ops.llmplug.skinny_gemv.default, (torch.randn(3, 16), torch.randn(8, 16), None,
                                                                      16, 16, 4, 1, fp32_out))
    with pytest.raises(ValueError, match="fp32_out"):
        skinny_gemv(torch.zeros(2, 16), w, gated="silu", fp32_out=True)


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_out_is_the_unrounded_product(bias):
    """``fp32_out``: a 16-bit product of a few rows comes back in fp32, not rounded (fp16 here: the interpreter's
    bf16 dot is not trusted; the GPU test covers bf16)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 200, generator=g).to(torch.float16)
    w = torch.randn(40, 200, generator=g).to(torch.float16)
    b = torch.randn(40, generator=g).to(torch.float16) if bias else None
    with cpu_kernels(True):
        got = skinny_gemv(x, w, b, config=(16, 64, 4, 1), fp32_out=True)
    assert got.dtype == torch.float32
    exact = skinny_gemv_ref(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)
    assert not torch.equal(got, got.to(torch.float16).float())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 3, 5, 8])
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, ""), (28672, 4096, "silu"), (4096, 14336, ""), (3072, 2048, "")])
def test_kernel_cuda_bf16(m, n, k, gated):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    got = skinny_gemv(x, w, None, gated)
    ref64 = skinny_gemv_ref(x.double(), w.double(), None, gated)
    assert_close_matmul_like(got, ref64, skinny_gemv_ref(x, w, None, gated))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(512, 256), (768, 4096), (8192, 256)])
def test_kernel_cuda_fp32(n, k):
    """fp32 weights get as many pipeline stages as fit in shared memory (four overflowed it: 240 KB at K >= 256)."""
    x = torch.randn(5, k, device="cuda")
    w = torch.randn(n, k, device="cuda") * 0.02
    got = skinny_gemv(x, w)
    torch.testing.assert_close(got, skinny_gemv_ref(x.double(), w.double()).float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("element_size", [1, 2, 4])
@pytest.mark.parametrize("k", [64, 256, 4096, 14336])
def test_config_fits_shared_memory(element_size, k):
    """The pipeline stages of every config fit the shared-memory budget (fp32's four stages at K >= 256 did not)."""
    from llmplug.ops.skinny_gemv import SHARED_BUDGET, choose_config, next_pow2

    block_n, block_k, _, stages = choose_config(4096, k, element_size)
    tile_k = min(block_k, next_pow2(k))  # the launch's BLOCK_K
    assert 1 <= stages <= 4 and stages * (block_n + 16) * tile_k * element_size <= SHARED_BUDGET


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8])
def test_fp32_out_cuda_bf16(m):
    """On the GPU in bf16, one row (gemv) or a few (skinny_gemv): the fp32 product, unrounded, with a bias."""
    from llmplug.ops.gemv import gemv

    x = torch.randn(m, 2048, device="cuda").to(torch.bfloat16)
    w = (torch.randn(4096, 2048, device="cuda") * 0.02).to(torch.bfloat16)
    b = torch.randn(4096, device="cuda").to(torch.bfloat16)
    got = gemv(x, w, b, fp32_out=True) if m == 1 else skinny_gemv(x, w, b, fp32_out=True)
    exact = x.double() @ w.double().T + b.double()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-4)
