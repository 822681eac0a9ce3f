"""A decode step's per-row KV bookkeeping from positions and block tables, in one launch (it was a dozen small
PyTorch kernels at the start of every CUDA-graph replay).

For row ``b`` with position ``p = positions[b]`` (``-1``: a padding row of the graph's batch bucket):

    clamped[b]  = max(p, 0)                                             position the model computes with
    slots[b]    = block_tables[b, p // P] * P + p % P   if p >= 0 else -1   where the new K/V go
    seq_lens[b] = p + 1                                 if p >= 0 else 0    cached tokens including the new one

NOTE: H200, 2026-11-22, ``benchmarks/ab_replay.py decode_slots``: decode graph replay 1B 0.8976 -> 0.8778 ms, 8B
4.0461 -> 4.0224 ms against the PyTorch reference's kernels.
"""

from __future__ import annotations

import torch

from ._triton import call_op, llmplug_op, maybe_wrap, next_pow2, pdl_options, tl, triton, use_triton, wait_inputs


def decode_slots_ref(positions: torch.Tensor, block_tables: torch.Tensor,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: ``positions (B,)`` int64, ``block_tables (B, M)`` int32 -> ``(clamped (B,) int64, slots (B,) int64,
    seq_lens (B,) int32)``."""
    pos = positions.clamp(min=0)
    page = block_tables.gather(1, (pos // block_size)[:, None]).squeeze(1).to(torch.long)
    valid = positions >= 0
    slots = torch.where(valid, page * block_size + pos % block_size, -1)
    return pos, slots, torch.where(valid, positions + 1, 0).to(torch.int32)


if triton is not None:

    @triton.jit
    def _decode_slots_kernel(pos_ptr, bt_ptr, clamped_ptr, slots_ptr, lens_ptr, B, stride_bt, PAGE: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_inputs(PDL)
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = rows < B
        p = tl.load(pos_ptr + rows, mask=mask, other=-1)
        valid = p >= 0
        q = tl.maximum(p, 0)
        page = tl.load(bt_ptr + rows.to(tl.int64) * stride_bt + q // PAGE, mask=mask & valid, other=0).to(tl.int64)
        tl.store(clamped_ptr + rows, q, mask=mask)
        tl.store(slots_ptr + rows, tl.where(valid, page * PAGE + q % PAGE, -1), mask=mask)
        tl.store(lens_ptr + rows, tl.where(valid, p + 1, 0).to(tl.int32), mask=mask)


@llmplug_op("decode_slots")
def _decode_slots_op(positions: torch.Tensor, block_tables: torch.Tensor,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(positions):
        return decode_slots_ref(positions, block_tables, block_size)
    rows = positions.shape[0]
    clamped, slots = torch.empty_like(positions), torch.empty_like(positions)
    lens = torch.empty(rows, dtype=torch.int32, device=positions.device)
    block = min(1024, next_pow2(rows))
    maybe_wrap(_decode_slots_kernel)[(triton.cdiv(rows, block),)](
        positions, block_tables, clamped, slots, lens, rows, block_tables.stride(0), PAGE=block_size, BLOCK=block,
        num_warps=1, **pdl_options(positions))
    return clamped, slots, lens


@_decode_slots_op.register_fake
def _(positions, block_tables, block_size):
    return torch.empty_like(positions), torch.empty_like(positions), positions.new_empty(positions.shape,
                                                                                         dtype=torch.int32)


def decode_slots(positions: torch.Tensor, block_tables: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(clamped positions, KV slots, sequence lengths)`` of a decode step (see the module docstring).

    Args:
        positions: ``(B,)`` int64, -1 for padding rows.
        block_tables: ``(B, M)`` int32 page ids, unit stride along M.
        block_size: tokens a page.

    Returns:
        ``clamped (B,) int64``, ``slots (B,) int64``, ``seq_lens (B,) int32``.
    """
    if positions.dim() != 1 or positions.dtype != torch.long:
        raise ValueError(f"positions must be (B,) int64, got {tuple(positions.shape)} {positions.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != positions.shape[0] or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be ({positions.shape[0]}, M) with unit stride along M, got "
                         f"{tuple(block_tables.shape)}")
    return call_op(_decode_slots_op, positions.contiguous(), block_tables, int(block_size))
