"""The fused forward's view of a row-parallel projection: each rank's partial product, summed over the ranks."""

from __future__ import annotations

import torch

from .group import TPGroup


class RowParallel:
    """``inner`` (a :class:`~llmplug.patches.decoder.Dense` or quantized linear over this rank's input columns) whose
    output is all-reduced: ``matmul(x (M, K / size)) -> (M, N)``, the full product on every rank.

    With ``fp32_shares`` (a plain weight: ``inner.matmul(x, fp32_out=True)``) each rank's share goes out unrounded and
    the sum is rounded once to ``x``'s dtype, as one GPU rounds its whole product (CPU bf16: 89% of the split logits
    bit-equal to one process's, against 15% with each share rounded; ``test_bf16_row_parallel_sums_are_rounded_once``).
    """

    def __init__(self, inner, tp: TPGroup, fp32_shares: bool = False) -> None:
        self.inner, self.tp, self.fp32_shares = inner, tp, fp32_shares

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_shares and x.dtype != torch.float32:
            return self.tp.all_reduce(self.inner.matmul(x, fp32_out=True), out_dtype=x.dtype)
        return self.tp.all_reduce(self.inner.matmul(x))
