"""``llmplug::all_reduce_add_rms_norm``: a row-parallel projection's all-reduce, then the residual add and RMSNorm
after it, as one op in a compiled graph (:mod:`llmplug.inductor.all_reduce` puts it there).

``(normed, total)`` with ``total = residual + scale * sum_ranks(x)`` rounded to ``x.dtype`` and ``normed =
rms_norm(total)``: what the graph computed before, bit for bit. The sum goes through the :class:`TPGroup` of the model
split over the traced collective's process group (:func:`~llmplug.parallel.group.register`: llmplug's one-shot kernel
where it is mapped and the message fits, as the eager hooks do), else through the process group itself; the rest is
:func:`~llmplug.ops.rms_norm.add_rms_norm`, in the same kernel as the sum where the one-shot path takes it
(:meth:`~llmplug.parallel.group.TPGroup.all_reduce_add_rms_norm`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.rms_norm import add_rms_norm
from .group import TPGroup


@torch.library.custom_op("llmplug::all_reduce_add_rms_norm", mutates_args=())
def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                            round_first: bool, scale: float, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x, residual: (..., N)`` of one dtype (``x`` this rank's share), ``weight (N,)``; ``eps, offset,
    round_first`` as :func:`~llmplug.ops.rms_norm.add_rms_norm`; ``scale`` multiplies the sum (Granite's residual
    multiplier; 1.0 for none); ``group_name``: the process group to sum over. Returns ``(normed, total)``, both shaped
    like ``x``."""
    n = x.shape[-1]
    share, residual = x.reshape(-1, n).clone(), residual.reshape(-1, n)  # the sum may go in place
    tp = TPGroup.named(group_name)
    if tp is not None:
        normed, total = tp.all_reduce_add_rms_norm(share, residual, weight, eps, offset, round_first, scale)
    else:
        dist.all_reduce(share, group=dist.distributed_c10d._resolve_process_group(group_name))
        normed, total = add_rms_norm(share * scale if scale != 1.0 else share, residual, weight, eps, offset,
                                     round_first)
    return normed.view(x.shape), total.view(x.shape)


@all_reduce_add_rms_norm.register_fake
def _(x, residual, weight, eps, offset, round_first, scale, group_name):
    return x.new_empty(x.shape), x.new_empty(x.shape)
