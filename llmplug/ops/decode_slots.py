"""A uniform step's per-token KV bookkeeping from positions and block tables, in one launch (it was a dozen small
PyTorch kernels at the start of every CUDA-graph replay).

Every row ``b`` computes ``Q`` new tokens (``Q = 1``: a decode step; ``1 + k``: a speculative verify) from position
``p = positions[b]`` (``-1``: a padding row of the graph's batch bucket). For its token ``t = b * Q + j``:

    clamped[t]  = max(p, 0) + j                                             position the model computes with
    slots[t]    = block_tables[b, c // P] * P + c % P  (c = clamped[t])  if p >= 0 else -1   where the new K/V go
    seq_lens[b] = p + Q                                                  if p >= 0 else 0    cached tokens after it

NOTE: faster decode graph replay than the reference's kernels (H200, 2026-11-22; BENCHMARKS.md, "H200 re-measured").
"""

from __future__ import annotations

import torch

from ._triton import call_op, llmplug_op, maybe_wrap, next_pow2, pdl_options, tl, triton, use_triton, wait_inputs


def decode_slots_ref(positions: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                     query_len: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: ``positions (B,)`` int64, ``block_tables (B, M)`` int32 -> ``(clamped (B*Q,) int64, slots (B*Q,)
    int64, seq_lens (B,) int32)``."""
    pos = (positions.clamp(min=0)[:, None] + torch.arange(query_len, device=positions.device)).reshape(-1)
    rows = torch.arange(positions.shape[0], device=positions.device).repeat_interleave(query_len)
    page = block_tables[rows, pos // block_size].to(torch.long)
    valid = positions.repeat_interleave(query_len) >= 0
    slots = torch.where(valid, page * block_size + pos % block_size, -1)
    return pos, slots, torch.where(positions >= 0, positions + query_len, 0).to(torch.int32)


if triton is not None:

    @triton.jit(do_not_specialize=["T", "Q"])
    def _decode_slots_kernel(pos_ptr, bt_ptr, clamped_ptr, slots_ptr, lens_ptr, T, stride_bt, Q, PAGE: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
        # T and Q are not specialised (on 1 or on multiples of 16): a step of a new shape must never compile a
        # variant mid-serving (H100 Engine runs showed 15-650 ms stalls)
        wait_inputs(PDL)
        tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = tokens < T
        rows = tokens // Q
        p = tl.load(pos_ptr + rows, mask=mask, other=-1)
        valid = p >= 0
        q = tl.maximum(p, 0) + tokens % Q
        page = tl.load(bt_ptr + rows.to(tl.int64) * stride_bt + q // PAGE, mask=mask & valid, other=0).to(tl.int64)
        tl.store(clamped_ptr + tokens, q, mask=mask)
        tl.store(slots_ptr + tokens, tl.where(valid, page * PAGE + q % PAGE, -1), mask=mask)
        tl.store(lens_ptr + rows, tl.where(valid, p + Q, 0).to(tl.int32), mask=mask & (tokens % Q == 0))


@llmplug_op("decode_slots")
def _decode_slots_op(positions: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                     query_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(positions):
        return decode_slots_ref(positions, block_tables, block_size, query_len)
    rows = positions.shape[0]
    tokens = rows * query_len
    clamped = positions.new_empty(tokens)
    slots = positions.new_empty(tokens)
    lens = torch.empty(rows, dtype=torch.int32, device=positions.device)
    block = min(1024, next_pow2(tokens)) if query_len == 1 else 1024  # one variant for every longer query
    maybe_wrap(_decode_slots_kernel)[(triton.cdiv(tokens, block),)](
        positions, block_tables, clamped, slots, lens, tokens, block_tables.stride(0), query_len, PAGE=block_size,
        BLOCK=block, num_warps=1, **pdl_options(positions))
    return clamped, slots, lens


@_decode_slots_op.register_fake
def _(positions, block_tables, block_size, query_len):
    tokens = positions.shape[0] * query_len
    return positions.new_empty(tokens), positions.new_empty(tokens), positions.new_empty(positions.shape,
                                                                                        dtype=torch.int32)


def decode_slots(positions: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                 query_len: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positions, KV slots, sequence lengths)`` of a uniform step (see the module docstring).

    Args:
        positions: ``(B,)`` int64 position of each row's first new token, -1 for padding rows.
        block_tables: ``(B, M)`` int32 page ids, unit stride along M.
        block_size: tokens a page.
        query_len: new tokens every row computes (``Q``).

    Returns:
        ``positions (B*Q,) int64`` (clamped at 0), ``slots (B*Q,) int64``, ``seq_lens (B,) int32``.
    """
    if positions.dim() != 1 or positions.dtype != torch.long:
        raise ValueError(f"positions must be (B,) int64, got {tuple(positions.shape)} {positions.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != positions.shape[0] or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be ({positions.shape[0]}, M) with unit stride along M, got "
                         f"{tuple(block_tables.shape)}")
    if query_len < 1:
        raise ValueError(f"query_len={query_len} must be >= 1")
    return call_op(_decode_slots_op, positions.contiguous(), block_tables, int(block_size), int(query_len))
