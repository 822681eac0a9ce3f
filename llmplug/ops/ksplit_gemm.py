"""A long-K GEMM at decode sizes as fp32 partial products over K slices, for a residual add + RMSNorm to sum.

At 9-256 rows a down projection (``K >= 2 N``) has too few output tiles to fill the GPU, so cuBLAS splits K and
sums the partials in a reduce kernel of its own: a kernel and a launch gap more per layer. :func:`ksplit_matmul`
runs one batched GEMM over ``S`` K slices instead and leaves the ``(S, M, N)`` fp32 partials to the add + norm that
follows (:func:`~llmplug.ops.rms_norm.parts_add_rms_norm`), which sums them in order and rounds the sum once, as
cuBLAS's reduce does. :func:`splits` is a fixed rule (the same choice in every process): four slices where
``K >= 4 N``, else two. NOTE: H200, bf16, down projection + add + norm, 1B (2048 x 8192) at 128 rows 18.2 -> 15.6 us,
8B (4096 x 14336) 40.1 -> 37.1 us; every row count 16-256 faster; the o projection (K = N) not always, so not
split (BENCHMARKS.md, "Fifth session of 2026-12-02").
"""

from __future__ import annotations

import torch

from .tuned_gemm import MAX_ROWS, MIN_ROWS

__all__ = ["ksplit_matmul", "slices_for", "splits"]

_DTYPES = (torch.bfloat16, torch.float16)


def slices_for(m: int, n: int, k: int) -> int:
    """The rule: K slices for ``(M, K) @ (N, K)^T`` in half precision on CUDA; 0 below ``MIN_ROWS`` or above
    ``MAX_ROWS`` rows, for ``K < 2 N`` and where a slice would not be 16-byte aligned; 4 where ``K >= 4 N``, else 2."""
    if not (MIN_ROWS <= m <= MAX_ROWS and k >= 2 * n):
        return 0
    s = 4 if k >= 4 * n else 2
    return s if k % (8 * s) == 0 else 0


def splits(x: torch.Tensor, weight: torch.Tensor) -> int:
    """:func:`slices_for` ``x (M, K) @ weight (N, K)^T`` where both are contiguous bf16/fp16 CUDA tensors of one
    dtype, else 0."""
    if not (x.is_cuda and x.dtype in _DTYPES and weight.dtype == x.dtype and x.is_contiguous()
            and weight.is_contiguous()):
        return 0
    return slices_for(x.shape[0], weight.shape[0], x.shape[1])


def ksplit_matmul(x: torch.Tensor, weight: torch.Tensor, slices: int) -> torch.Tensor:
    """``x (M, K) @ weight (N, K)^T`` as ``(slices, M, N)`` fp32 partial products, slice ``s`` over
    ``K[s * K / slices : (s + 1) * K / slices]`` (one strided batched GEMM; no copy of either operand)."""
    m, k = x.shape
    n = weight.shape[0]
    if k % slices:
        raise ValueError(f"K={k} is not a multiple of slices={slices}")
    a = x.view(m, slices, k // slices).transpose(0, 1)  # (S, M, K / S)
    b = weight.view(n, slices, k // slices).permute(1, 2, 0)  # (S, K / S, N)
    if x.dtype == torch.float32:
        return torch.bmm(a, b)
    return torch.bmm(a, b, out_dtype=torch.float32)
