"""The tensor-parallel group a model is split over, and its collectives."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..ops.rms_norm import add_rms_norm

# torch 2.13 renamed all_gather_into_tensor (one output tensor, the inputs along dim 0); 2.11 has only the old name
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_HOST_GROUPS: dict[str, object] = {}  # process group name -> its gloo twin for host-side messages
_GROUPS: dict[str, TPGroup] = {}  # process group name -> the TPGroup of the model split over it (:func:`register`)


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group: ``rank`` of ``size`` ranks of ``group`` (None: the world).

    On CUDA, all-reduces of up to :data:`~llmplug.parallel.one_shot.SLOT_BYTES` go through llmplug's one-shot kernel
    over a symmetric-memory buffer every rank maps (:mod:`llmplug.parallel.one_shot`) once :meth:`prepare` made it,
    larger ones through NCCL; ``LLMPLUG_TP_ALLREDUCE=nccl`` in the environment sends every one to NCCL. On CPUs: gloo.
    NOTE: two H100s, 8B shape, 93c4f80: 8 KB inside a CUDA graph 5.5 us one-shot vs 16.7 NCCL; batch-1 decode at TP=2
    275.4 vs 263.2 tok/s (BENCHMARKS.md, "Tensor parallelism: llmplug's one-shot all-reduce").
    """

    rank: int
    size: int
    group: object = None
    _symm: dict = field(default_factory=dict, compare=False, repr=False)  # "one_shot" -> its OneShot, once mapped

    @property
    def group_name(self) -> str:
        return (self.group or dist.group.WORLD).group_name

    @staticmethod
    def named(group_name: str) -> TPGroup | None:
        """The :func:`register`-ed group over process group ``group_name`` (a traced collective's group), if any."""
        return _GROUPS.get(group_name)

    @property
    def one_shot(self):
        """The mapped :class:`~llmplug.parallel.one_shot.OneShot` all-reduce (:meth:`prepare`), or None (NCCL)."""
        return self._symm.get("one_shot")

    def prepare(self, device: torch.device) -> None:
        """On CUDA, map the one-shot all-reduce's buffer on every rank (collective: every rank calls it together);
        NCCL alone with ``LLMPLUG_TP_ALLREDUCE=nccl`` or where CUDA symmetric memory fails."""
        mode = os.environ.get("LLMPLUG_TP_ALLREDUCE", "one_shot")
        if mode not in ("one_shot", "nccl"):
            raise ValueError(f"LLMPLUG_TP_ALLREDUCE={mode!r}: expected 'one_shot' (the default) or 'nccl'")
        if device.type != "cuda" or self._symm or mode != "one_shot":
            return
        try:
            from .one_shot import map_one_shot

            self._symm["one_shot"] = map_one_shot(self.group_name, device)
        except Exception as error:  # noqa: BLE001 - any failure leaves NCCL in charge
            warnings.warn(f"symmetric memory is unavailable ({error}); tensor-parallel all-reduces use NCCL",
                          stacklevel=2)

    def all_reduce(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, fence: bool = False) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``, or with ``out_dtype`` the sum in that dtype (fp32
        partial products summed before one rounding). ``fence``: through NCCL whatever the size, so that no rank
        runs past it before every rank has finished its earlier kernels (:mod:`llmplug.parallel.one_shot`)."""
        one_shot = self.one_shot
        if one_shot is not None and one_shot.fits(x) and not fence:
            same = out_dtype in (None, x.dtype)
            return one_shot(x, x if same else torch.empty(x.shape, dtype=out_dtype, device=x.device))
        dist.all_reduce(x, group=self.group)
        return x if out_dtype is None else x.to(out_dtype)

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                offset: float, round_first: bool,
                                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, total)``: ``total = residual + scale * (x summed over the ranks)`` and ``normed`` its RMSNorm
        (:func:`~llmplug.ops.rms_norm.add_rms_norm`), in ``residual``'s dtype; ``x, residual: (M, N)``, ``x`` this
        rank's share (fp32 shares are rounded once, after the sum). One kernel where the one-shot path takes ``x``
        (:meth:`~llmplug.parallel.one_shot.OneShot.add_rms_norm`); otherwise :meth:`all_reduce`, which sums ``x``
        in place, then ``add_rms_norm``."""
        one_shot = self.one_shot
        if one_shot is not None and one_shot.fits(x) and residual.is_contiguous():
            return one_shot.add_rms_norm(x, residual, weight, eps, offset, round_first, scale)
        total = self.all_reduce(x, out_dtype=residual.dtype)
        if scale != 1.0:
            total = total * scale
        return add_rms_norm(total, residual, weight, eps, offset, round_first)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` (on the model's device) on every rank, in place, queued on the stream like any kernel;
        returns ``x``."""
        dist.broadcast(x, src=self._rank0(), group=self.group)
        return x

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's ``payload`` (host bytes; the other ranks pass None) on every rank, over the host group
        (:meth:`host_group`): no GPU stream is involved, so no rank waits for its device."""
        host = self.host_group()
        size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=self._rank0(), group=host)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
            torch.empty(int(size.item()), dtype=torch.uint8)
        if data.numel():
            dist.broadcast(data, src=self._rank0(), group=host)
        return payload if payload is not None else data.numpy().tobytes()

    def agree(self, value: float) -> float:
        """Rank 0's ``value`` (a host decision input, such as a measured time, that must be the same everywhere)."""
        out = torch.tensor([value], dtype=torch.float64)
        dist.broadcast(out, src=self._rank0(), group=self.host_group())
        return float(out.item())

    def sync_rng(self, device: torch.device) -> None:
        """Give every rank rank 0's random state (the CPU generator, and ``device``'s when it is CUDA), so sampling
        from the identical gathered logits draws the same tokens everywhere."""
        states = [(torch.get_rng_state, torch.set_rng_state)]
        if device.type == "cuda":
            states.append((lambda: torch.cuda.get_rng_state(device), lambda s: torch.cuda.set_rng_state(s, device)))
        for get, put in states:
            state = get()  # a host tensor either way
            dist.broadcast(state, src=self._rank0(), group=self.host_group())
            put(state)

    def host_group(self):
        """A gloo group over the same ranks for host-side messages (requests, measured times, random states), made
        once (by :func:`resolve`, on every rank) and shared by every group over these ranks."""
        key = self.group_name
        if key not in _HOST_GROUPS:
            ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
            _HOST_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
        return _HOST_GROUPS[key]

    def _rank0(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        """``x (N, ...)`` of every rank -> ``(size, N, ...)``, rank order."""
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _gather(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., N)`` of every rank side by side -> ``(..., size * N)``, rank order."""
        return torch.cat(list(self.stack(x).unbind(0)), dim=-1)


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
    if world == 1:
        return None
    group = TPGroup(dist.get_rank(), world)
    group.host_group()  # made now, while every rank is here (a collective; later a dead rank would hang it)
    return group


def register(group: TPGroup) -> Callable[[], None]:
    """Make ``group`` the one :meth:`TPGroup.named` finds for its process group (the group a model was split over,
    whose all-reduce path compiled graphs then take); returns the undo, which forgets it again."""
    _GROUPS[group.group_name] = group

    def forget() -> None:
        if _GROUPS.get(group.group_name) is group:
            del _GROUPS[group.group_name]

    return forget
