"""Pack a :class:`StepPlan` into the flat tensors the model runner takes."""

from __future__ import annotations

import itertools

import torch

from .metadata import AttentionMetadata
from .request import Sequence


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without blocking the host (through pinned memory on CUDA)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def block_table(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    """``(B, longest)`` int32 page ids of each sequence, zero-padded, on ``device``."""
    width = max(len(s.blocks) for s in seqs)
    return to_device(torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs], dtype=torch.int32),
                     device)


def decode_inputs(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids (B,)``, ``positions (B,)`` and ``block_tables (B, M)`` of a step where every row decodes."""
    host = torch.tensor([[s.tokens[-1] for s in seqs], [s.num_computed for s in seqs]], dtype=torch.long)
    dev = to_device(host, device)
    return dev[0], dev[1], block_table(seqs, device)


def prefill_inputs(seqs: list[Sequence], num_new: list[int], block_size: int, device: torch.device):
    """Packed inputs of a mixed step: ``input_ids, positions (T,)``, metadata, ``last (B,)`` row of each sequence."""
    starts = torch.tensor([s.num_computed for s in seqs], dtype=torch.long)
    lens = torch.tensor(num_new, dtype=torch.long)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.long)
    torch.cumsum(lens, 0, out=cu[1:])
    total = int(cu[-1])
    row = torch.repeat_interleave(torch.arange(len(seqs)), lens)
    positions = torch.arange(total) - cu[:-1][row] + starts[row]
    ids = torch.tensor(list(itertools.chain.from_iterable(
        s.tokens[s.num_computed:s.num_computed + n] for s, n in zip(seqs, num_new))), dtype=torch.long)
    ids, positions, row = to_device(torch.stack([ids, positions, row]), device)
    small = to_device(torch.cat([cu, starts]), device)
    cu, starts = small[:len(seqs) + 1], small[len(seqs) + 1:]
    tables = block_table(seqs, device)
    slots = tables[row, positions // block_size].long() * block_size + positions % block_size
    nd = next((i for i, n in enumerate(num_new) if n != 1), len(num_new))  # leading one-token rows
    ctx = starts.to(torch.int32)
    meta = AttentionMetadata(is_decode=False, slot_mapping=slots, block_tables=tables,
                             cu_seqlens_q=cu.to(torch.int32), context_lens=ctx,
                             max_seqlen_q=max(num_new[nd:], default=1), num_decodes=nd, seq_lens=ctx[:nd] + 1)
    return ids, positions, meta, cu[1:] - 1
