"""A long-K GEMM at decode sizes as fp32 partial products over K slices, for a residual add + RMSNorm to sum.

At 9-256 rows a down projection (K several times N) has too few output tiles to fill the GPU, so cuBLAS splits K and
sums the partials in a reduce kernel of its own: a kernel and a launch gap more per layer. :func:`ksplit_matmul`
runs one batched GEMM over ``S`` K slices instead and leaves the ``(S, M, N)`` fp32 partials to the add + norm that
follows (:func:`~llmplug.ops.rms_norm.parts_add_rms_norm`), which sums them in order and rounds the sum once, as
cuBLAS's reduce does. :func:`splits` is a fixed rule (the same choice in every process): four slices where
``K >= 4 N``. NOTE: H200, bf16, the 1B's down projection + add + norm at 128 rows 18.2 -> 15.6 us, its Engine's
workload (b) 69.6-70.2 -> 70.7-71.0% of the floor; two slices of the 8B's made its (b) slower (80.6 -> 76.8%) though
faster alone; the o projection (K = N) not always faster (BENCHMARKS.md, "Fifth session of 2026-12-02").
"""

from __future__ import annotations

import torch

from .tuned_gemm import MAX_ROWS, MIN_ROWS

__all__ = ["ksplit_matmul", "slices_for", "splits"]

_DTYPES = (torch.bfloat16, torch.float16)


def slices_for(m: int, n: int, k: int) -> int:
    """The rule: K slices for ``(M, K) @ (N, K)^T`` in half precision on CUDA: 4 at ``MIN_ROWS`` to ``MAX_ROWS``
    rows where ``K >= 4 N`` and a slice stays 16-byte aligned, else 0. (Two slices of the 8B's down projection,
    ``K = 3.5 N``, were faster alone but made the 8B Engine slower, so shapes like it keep cuBLAS's split-K.)"""
    if not (MIN_ROWS <= m <= MAX_ROWS and k >= 4 * n and k % 32 == 0):
        return 0
    return 4


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
