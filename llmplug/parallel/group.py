"""The tensor-parallel group a model is split over, and its collectives."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (one output tensor, the inputs along dim 0); 2.11 has only the old name
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group: ``rank`` of ``size`` ranks of ``group`` (None: the world)."""

    rank: int
    size: int
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        dist.all_reduce(x, group=self.group)
        return x

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        """``x (N, ...)`` of every rank -> ``(size, N, ...)``, rank order."""
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _gather(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., N)`` of every rank side by side -> ``(..., size * N)``, rank order."""
        return torch.cat(list(self.stack(x).unbind(0)), dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank, in place; returns ``x``."""
        dist.broadcast(x, src=dist.get_global_rank(self.group, src) if self.group is not None else src,
                       group=self.group)
        return x


def resolve(tensor_parallel: int | str | None) -> TPGroup | None:
    """``OptimizeConfig.tensor_parallel`` -> the group, or None for one process. ``"auto"`` is the world size when
    ``torch.distributed`` is initialised (as under ``torchrun``), else one process; an int must equal the world size.
    """
    if tensor_parallel in (None, 1) or (tensor_parallel == "auto" and not dist.is_initialized()):
        return None
    if not dist.is_initialized():
        raise RuntimeError(f"tensor_parallel={tensor_parallel!r} needs torch.distributed initialised on every rank "
                           "(launch with torchrun --nproc-per-node N and call torch.distributed.init_process_group)")
    world = dist.get_world_size()
    if tensor_parallel != "auto" and tensor_parallel != world:
        raise ValueError(f"tensor_parallel={tensor_parallel!r} must equal the world size ({world}) or be 'auto'")
    return None if world == 1 else TPGroup(dist.get_rank(), world)
