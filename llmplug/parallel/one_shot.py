"""A one-shot all-reduce over CUDA symmetric memory, one Triton kernel with one cross-GPU barrier (GPU only).

Every rank maps a buffer of two slots that every other rank can read over NVLink. A call stages this rank's input into
the next slot, meets the same block of every peer at a barrier of flags in the peers' signal pads, then sums every
rank's slot in rank order (fp32, so every rank gets the same bits) into the output: the input itself, or a tensor of
another dtype (fp32 partial products summed, then rounded once to bf16).

One barrier is enough because consecutive calls use the two slots in turn: a rank writes a slot again only after the
barrier of the call between, which every peer reaches only once its kernel that read the slot has finished. Kernels
on a stream run in order; under programmatic dependent launch every kernel of a step waits for its predecessor to
finish before it writes anything or lets its successor launch, so a kernel's writes still follow the end of every
earlier kernel. A captured graph keeps that order within it; where two graphs (or a graph and eager calls) meet, the
order is their capture's, so every forward opens with a fence: the embedding's all-reduce goes through NCCL
(``TPGroup.all_reduce(fence=True)``), which no rank leaves before every rank has finished its earlier kernels.
The flags reset themselves (set 0 -> 1 by the sender, 1 -> 0 by the receiver), so
the kernel replays in CUDA graphs. The CPU path (gloo) is plain ``dist.all_reduce``; GPU tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops._triton import next_pow2, pdl_options, wait_inputs
from ..ops.rms_norm import rms_scale

SLOT_BYTES = 512 << 10  # the largest message that takes this path (32 tokens of an 8B model's hidden state, fp32)
BLOCK = 1024  # elements a program moves per pass: 8 per thread of 4 warps (16-byte vectors in bf16)
MIN_PROGRAMS = 32  # each program meets its peers at its own flags: the pads must hold MIN_PROGRAMS * world
# NOTE: 2x H200, 2026-11-27 (BENCHMARKS.md, "one-shot program cap"): a cap of 128 takes 256 KB from 8.2 to 6.0 us
PROGRAMS = 128  # default cap on a call's programs (up to what the pads hold); smaller messages use fewer


@triton.jit
def _meet_peers(pads, own_flags, send_offset, world):
    """Block-wide barrier with the same program of every rank: thread ``t < world`` raises this rank's flag in rank
    ``t``'s pad (``pads[t] + send_offset`` bytes; release, so this block's writes before it are visible there), then
    waits for rank ``t``'s flag in its own (``own_flags[t]``; acquire) and lowers it. The caller syncs the block on
    either side. Every operand is an int64 (addresses as integers: Triton 3.6 refuses pointers of two types here)."""
    tl.inline_asm_elementwise(
        """
        {
        .reg .u32 %llp_t, %llp_old;
        .reg .u64 %llp_a, %llp_off, %llp_t64;
        .reg .pred %llp_p;
        mov.u32 %llp_t, %tid.x;
        cvt.u64.u32 %llp_t64, %llp_t;
        setp.ge.u64 %llp_p, %llp_t64, $4;
        @%llp_p bra LLP_DONE;
        mul.wide.u32 %llp_off, %llp_t, 8;
        add.u64 %llp_a, $1, %llp_off;
        ld.global.u64 %llp_a, [%llp_a];
        add.u64 %llp_a, %llp_a, $3;
        LLP_SEND:
        atom.global.release.sys.cas.b32 %llp_old, [%llp_a], 0, 1;
        setp.ne.u32 %llp_p, %llp_old, 0;
        @%llp_p bra LLP_SEND;
        mul.wide.u32 %llp_off, %llp_t, 4;
        add.u64 %llp_a, $2, %llp_off;
        LLP_WAIT:
        atom.global.acquire.sys.cas.b32 %llp_old, [%llp_a], 1, 0;
        setp.ne.u32 %llp_p, %llp_old, 1;
        @%llp_p bra LLP_WAIT;
        LLP_DONE:
        mov.u32 $0, 0;
        }
        """,
        "=r,l,l,l,l",
        [pads, own_flags, send_offset, world],
        dtype=tl.uint32, is_pure=False, pack=1,
    )


@triton.jit
def _slot(bufs, rank, slot_offset, elem: tl.constexpr):
    """This call's slot in ``rank``'s mapped buffer, as a pointer to ``elem`` (no kernel writes ``bufs``)."""
    return tl.multiple_of(tl.load(bufs + rank).to(tl.pointer_type(elem)) + slot_offset, 16)


@triton.jit
def _barrier(pads, rank: tl.constexpr, world: tl.constexpr):
    """Every program meets the same program of every rank (:func:`_meet_peers` on this program's row of flags), with
    the block synced on either side: what it stored into its slot before is then visible to the peers."""
    pid = tl.program_id(0)
    tl.debug_barrier()
    own_flags = tl.load(pads + rank) + (pid * world).to(tl.int64) * 4  # this program's row of flags, an address
    send_offset = (pid * world + rank).to(tl.int64) * 4
    _meet_peers(pads.to(tl.int64), own_flags, send_offset, send_offset * 0 + world)
    tl.debug_barrier()


@triton.jit
def _peer_sum(bufs, slot_offset, offs, mask, elem: tl.constexpr, world: tl.constexpr, BLOCK: tl.constexpr):
    """fp32 ``(BLOCK,)``: the sum over the ranks, in rank order, of their slots' elements at ``offs``."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for peer in tl.static_range(world):
        acc += tl.load(_slot(bufs, peer, slot_offset, elem) + offs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, bufs, pads, slot_offset, numel, rank: tl.constexpr, world: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``out (numel,)`` <- the sum over ranks of every rank's ``x (numel,)`` (``out`` may be ``x``). ``bufs``/``pads``:
    ``(world,)`` int64 addresses of each rank's buffer and signal pad; ``slot_offset``: elements of ``x``'s dtype to
    this call's slot in a buffer. Under programmatic dependent launch (``PDL``) it waits for its input like llmplug's
    other kernels and then lets the next kernel launch, which reads its weights during the barrier."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    elem = x_ptr.dtype.element_ty
    own = _slot(bufs, rank, slot_offset, elem)
    wait_inputs(PDL)
    for start in range(pid * BLOCK, numel, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(own + offs, tl.load(x_ptr + offs, mask=offs < numel), mask=offs < numel)
    _barrier(pads, rank, world)
    for start in range(pid * BLOCK, numel, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc = _peer_sum(bufs, slot_offset, offs, offs < numel, elem, world, BLOCK)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < numel)


@triton.jit
def _one_shot_add_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, total_ptr, bufs, pads, slot_offset, M, N, eps, offset,
                              scale, rank: tl.constexpr, world: tl.constexpr, BLOCK: tl.constexpr,
                              SCALED: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """:func:`_one_shot_kernel` over whole rows, then the residual add and RMSNorm of each: ``x (M, N)`` this rank's
    share; ``total (M, N)`` <- ``residual + scale * sum`` and ``out (M, N)`` <- its RMSNorm, both in ``out``'s dtype
    and rounded as the unfused ops round (the sum, the scaled sum, the residual sum, then as ``rms_norm``)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    elem = x_ptr.dtype.element_ty
    dt = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    own = _slot(bufs, rank, slot_offset, elem)
    for row in range(pid, M, programs):
        offs = row.to(tl.int64) * N + cols
        tl.store(own + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _barrier(pads, rank, world)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32)
    for row in range(pid, M, programs):
        offs = row.to(tl.int64) * N + cols
        y = _peer_sum(bufs, slot_offset, offs, mask, elem, world, BLOCK).to(dt).to(tl.float32)  # the all-reduce's sum
        if SCALED:
            y = (y * tl.cast(scale, tl.float32)).to(dt).to(tl.float32)
        total = (y + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
        tl.store(total_ptr + offs, total, mask=mask)
        t = total.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(t * t, axis=0) / N + tl.cast(eps, tl.float32))
        tl.store(out_ptr + offs, rms_scale(t, rstd, w, dt, ROUND_FIRST, False).to(dt), mask=mask)


class OneShot:
    """The mapped buffer of this rank (``2 * SLOT_BYTES``), every rank's addresses, and the slot the next call uses.

    ``handle``: the rendezvous of ``buffer`` (``torch.distributed._symmetric_memory``) over the group."""

    def __init__(self, buffer: torch.Tensor, handle) -> None:
        self.buffer = buffer  # owned here: the peers read it for as long as this object lives
        self.rank, self.world = handle.rank, handle.world_size
        self.max_programs = handle.signal_pad_size // (self.world * 4)  # one flag a program and peer
        if self.max_programs < MIN_PROGRAMS:
            raise RuntimeError(f"the signal pads hold {handle.signal_pad_size} bytes; the one-shot all-reduce needs "
                               f"{MIN_PROGRAMS * self.world * 4}")
        self.programs = min(PROGRAMS, self.max_programs)  # at most this many programs a call
        start = buffer.data_ptr() - handle.buffer_ptrs[self.rank]  # where the buffer sits in each mapped allocation
        device = buffer.device
        self.bufs = torch.tensor([p + start for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
        self.pads = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)
        self.slot = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.is_contiguous() and x.numel() * x.element_size() <= SLOT_BYTES

    def _next_slot(self, x: torch.Tensor) -> int:
        """This call's slot, as an offset in elements of ``x``'s dtype; the next call takes the other one."""
        offset = self.slot * (SLOT_BYTES // x.element_size())
        self.slot ^= 1
        return offset

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (contiguous, at most ``SLOT_BYTES``) over the ranks into ``out`` (``x`` itself, or a contiguous
        tensor of its shape); returns ``out``."""
        numel = x.numel()
        programs = max(1, min(triton.cdiv(numel, BLOCK), self.programs))
        _one_shot_kernel[(programs,)](x, out, self.bufs, self.pads, self._next_slot(x), numel, rank=self.rank,
                                      world=self.world, BLOCK=BLOCK, num_warps=4, **pdl_options(x))
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                     round_first: bool, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum of ``x (M, N)`` (contiguous, at most ``SLOT_BYTES``) over the ranks, times ``scale``, plus
        ``residual (M, N)`` (contiguous), and that total's RMSNorm, in one kernel -> ``(normed, total)``, both in
        ``residual``'s dtype (``x`` may be fp32 shares)."""
        m, n = x.shape
        programs = max(1, min(m, self.programs))
        normed, total = torch.empty_like(residual), torch.empty_like(residual)
        block = next_pow2(n)
        _one_shot_add_norm_kernel[(programs,)](x, residual, weight, normed, total, self.bufs, self.pads,
                                               self._next_slot(x), m, n, eps, offset, scale, rank=self.rank,
                                               world=self.world, BLOCK=block,
                                               SCALED=scale != 1.0, ROUND_FIRST=round_first,
                                               num_warps=min(16, max(4, block // 512)))
        return normed, total


def map_one_shot(group_name: str, device: torch.device) -> OneShot:
    """Allocate and map the buffer on every rank of ``group_name`` (collective: every rank calls it together)."""
    import warnings

    import torch.distributed._symmetric_memory as symm

    if not symm.is_symm_mem_enabled_for_group(group_name):  # torch 2.11 needs it; 2.13 deprecates it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(group_name)
    buffer = symm.empty(2 * SLOT_BYTES, dtype=torch.uint8, device=device)
    return OneShot(buffer, symm.rendezvous(buffer, group_name))
