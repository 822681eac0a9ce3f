"""The fused forward's view of a row-parallel projection: each rank's partial product, summed over the ranks."""

from __future__ import annotations

import torch

from .group import TPGroup


class RowParallel:
    """``inner`` (a :class:`~llmplug.patches.decoder.Dense` or quantized linear over this rank's input columns) whose
    output is all-reduced: ``matmul(x (M, K / size)) -> (M, N)``, the full product on every rank.

    A plain weight's share goes out unrounded (``inner.partial``: fp32) and the sum is rounded once to ``x``'s dtype,
    as one GPU rounds its whole product; bf16 shares rounded each before the sum made TP=2's greedy tokens part from
    TP=1's on 15% of a trained model's prompts (BENCHMARKS.md, "Tensor parallelism")."""

    def __init__(self, inner, tp: TPGroup) -> None:
        self.inner, self.tp = inner, tp

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        partial = getattr(self.inner, "partial", None)
        if partial is None or x.dtype == torch.float32:
            return self.tp.all_reduce(self.inner.matmul(x))
        return self.tp.all_reduce(partial(x), out_dtype=x.dtype)
