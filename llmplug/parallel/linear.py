"""The fused forward's view of a row-parallel projection: each rank's partial product, summed over the ranks."""

from __future__ import annotations

import torch

from .group import TPGroup


class RowParallel:
    """``inner`` (a :class:`~llmplug.patches.decoder.Dense` or quantized linear over this rank's input columns) whose
    output is all-reduced: ``matmul(x (M, K / size)) -> (M, N)``, the full product on every rank."""

    def __init__(self, inner, tp: TPGroup) -> None:
        self.inner, self.tp = inner, tp

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.inner.matmul(x))
