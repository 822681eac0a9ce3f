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

    def _share(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product of ``x (M, K / size)``: fp32 with ``fp32_shares`` (a 16-bit ``x``)."""
        fp32 = self.fp32_shares and x.dtype != torch.float32
        return self.inner.matmul(x, fp32_out=True) if fp32 else self.inner.matmul(x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self._share(x), out_dtype=x.dtype)

    def all_reduce_add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            offset: float, round_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm(matmul(x), residual, weight, ...)`` -> ``(normed, matmul(x) + residual)``, the sum over the
        ranks, the add and the norm in one kernel where the one-shot all-reduce takes the share
        (:meth:`~llmplug.parallel.group.TPGroup.all_reduce_add_rms_norm`)."""
        return self.tp.all_reduce_add_rms_norm(self._share(x), residual, weight, eps, offset, round_first)
