"""One step of the model, described in one place: which tokens of which sequences it computes, packed for the runner.

Every front end (``generate``, the Engine, scoring) builds its steps with :func:`build_step`. A step is *uniform* when
every sequence computes the same number of new tokens ``Q`` (``1``: a decode; ``1 + k``: a speculative verify): its
positions, KV slots and lengths then follow on the device from each row's first position and its pages
(:func:`uniform_metadata`), so a CUDA graph keyed by (rows bucket, ``Q``) replays it. Any other step is *packed*: its
metadata is built here on the host.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..ops.decode_slots import decode_slots
from .metadata import AttentionMetadata

# NOTE: verify steps' attention on the decode kernel, a row per token: H100, 8B shape, q = 5 at batch 64 2.12x -> 1.61x
# a decode step (BENCHMARKS.md, "Speculative decoding: verify graph, decode-kernel attention, measured costs").
DECODE_KERNEL_QUERY = 8


@dataclass
class StepContext:
    """A forward over ``B`` sequences packed into ``T`` token rows; tensors on the model's device.

    Attributes:
        input_ids: ``(T,) int64``.
        block_tables: ``(B, M) int32`` page ids of each sequence.
        query_len: new tokens of every row of a uniform step (``T == B * query_len``); 0 when rows differ.
        positions: uniform: ``(B,) int64`` position of each row's first new token (-1: a padding row); packed:
            ``(T,)`` of every token.
        meta: packed: the step's :class:`AttentionMetadata`; uniform: None (:func:`uniform_metadata` derives it).
        logits_indices: ``(R,)`` token rows whose logits the step returns; None: every row.
        row_starts: host ints, ``(B,)`` the first token row of each sequence.
    """

    input_ids: torch.Tensor
    block_tables: torch.Tensor
    query_len: int
    positions: torch.Tensor
    meta: AttentionMetadata | None
    logits_indices: torch.Tensor | None
    row_starts: list[int]

    @property
    def num_rows(self) -> int:
        return self.block_tables.shape[0]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without blocking the host (through pinned memory on CUDA)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def device_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device`` without stalling the host: ``torch.tensor(values, device=cuda)`` waits
    for the stream's queued work (a blocking copy from pageable memory), which breaks the Engine's step ahead."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def block_table(blocks: list[list[int]], device: torch.device) -> torch.Tensor:
    """``(B, longest)`` int32 page ids of each sequence (``blocks[b]``), zero-padded, on ``device``."""
    width = max(map(len, blocks))
    return to_device(torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.int32), device)


def uniform_metadata(positions: torch.Tensor, block_tables: torch.Tensor, block_size: int, query_len: int,
                     every_token: bool = False) -> tuple[torch.Tensor, AttentionMetadata]:
    """A uniform step's metadata from device tensors alone: ``positions (B,)`` of each row's first new token (-1:
    padding), ``block_tables (B, M)`` -> ``(positions (B*Q,) clamped at 0, metadata)``. Decode steps (``Q == 1``)
    and, when ``every_token``'s logits are wanted (verification), steps of up to ``DECODE_KERNEL_QUERY`` tokens a
    row (every token a row of its own) attend on the decode kernel; other queries on the prefill kernel (each row's
    context is its cached tokens), so the Engine's uniform prefill chunks launch no decode-kernel variant that warm-up
    did not compile."""
    token_positions, slots, seq_lens = decode_slots(positions, block_tables, block_size, query_len)
    if query_len == 1:
        return token_positions, AttentionMetadata(query_len=1, slot_mapping=slots, block_tables=block_tables,
                                                  seq_lens=seq_lens)
    rows = block_tables.shape[0]
    if every_token and query_len <= DECODE_KERNEL_QUERY:  # each token a decode row, attending up to itself
        steps = torch.arange(1 - query_len, 1, dtype=torch.int32, device=positions.device)
        lens = torch.where(seq_lens[:, None] > 0, seq_lens[:, None] + steps, 0).reshape(-1)
        return token_positions, AttentionMetadata(query_len=query_len, slot_mapping=slots, block_tables=block_tables,
                                                  token_seq_lens=lens,
                                                  token_block_tables=block_tables.repeat_interleave(query_len, 0))
    cu = torch.arange(0, (rows + 1) * query_len, query_len, dtype=torch.int32, device=positions.device)
    context = (seq_lens - query_len).clamp_(min=0)
    return token_positions, AttentionMetadata(query_len=query_len, slot_mapping=slots, block_tables=block_tables,
                                              cu_seqlens_q=cu, context_lens=context, max_seqlen_q=query_len)


def build_step(seqs, num_new: list[int], block_size: int, device: torch.device, *,
               input_ids: torch.Tensor | None = None, block_tables: torch.Tensor | None = None,
               positions: torch.Tensor | None = None, all_logits: bool = False,
               num_logits: list[int] | None = None) -> StepContext:
    """Pack ``seqs[i]``'s next ``num_new[i]`` tokens (from position ``seqs[i].num_computed``) into one step.

    Args:
        seqs: objects with ``tokens`` (list of ids), ``num_computed`` and ``blocks`` (their page ids, enough for the
            step's tokens): the Engine's :class:`~llmplug.engine.request.Sequence`.
        num_new: tokens each sequence computes (>= 1).
        input_ids: ``(T,)`` the step's token ids: on the device (e.g. tokens the device just chose), or on the host
            (sent with the step's other host data in one copy); None reads them from ``seqs[i].tokens``.
        block_tables: ``(B, M)`` the sequences' page table already on the device; None builds it.
        positions: ``(B,)`` int64 on the device, each row's ``num_computed``, for a uniform step whose
            ``input_ids`` are on the device too: then nothing goes from the host to the device. None reads them from
            ``seqs``.
        all_logits: return every token's logits (verification, scoring); else each sequence's last token's.
        num_logits: per sequence, how many of its last tokens' logits to return (0: none; a verified row: all its
            tokens), in row order; overrides ``all_logits``.

    Returns:
        The :class:`StepContext`.
    """
    rows = len(seqs)
    starts = list(itertools.accumulate(num_new, initial=0))
    uniform = num_new[0] if all(n == num_new[0] for n in num_new) else 0
    if positions is not None and not (uniform and input_ids is not None and input_ids.device == device):
        raise ValueError("build_step: positions= is for uniform steps whose input_ids are on the device")
    firsts = None if positions is not None else [s.num_computed for s in seqs]
    picked = None  # the token rows whose logits come back, when num_logits picks some
    if num_logits is not None:
        all_logits = list(num_logits) == list(num_new)
        if not all_logits:
            picked = to_device(torch.tensor([s + n - c + j for s, n, c in zip(starts, num_new, num_logits)
                                             for j in range(c)], dtype=torch.long), device)
    if input_ids is None:  # the ids go to the device with the step's other host data
        ids = list(itertools.chain.from_iterable(s.tokens[c:c + n] for s, c, n in zip(seqs, firsts, num_new)))
    elif input_ids.device != device:
        ids, input_ids = input_ids.tolist(), None
    else:
        ids = []
    tables = block_tables if block_tables is not None else block_table([s.blocks for s in seqs], device)
    if uniform:
        last = picked
        if picked is None and not all_logits and uniform > 1:
            last = torch.arange(uniform - 1, rows * uniform, uniform, device=device)
        if positions is not None:
            return StepContext(input_ids, tables, uniform, positions, None, last, starts[:-1])
        small = to_device(torch.tensor(firsts + ids, dtype=torch.long), device)
        return StepContext(input_ids if input_ids is not None else small[rows:], tables, uniform, small[:rows], None,
                           last, starts[:-1])
    total = starts[-1]
    host = to_device(torch.tensor(starts + firsts + num_new + ids, dtype=torch.long), device)  # one copy
    cu_dev, first_dev, lens = host[:rows + 1], host[rows + 1:2 * rows + 1], host[2 * rows + 1:3 * rows + 1]
    # NOTE: each token's row and position are made on the device: CPU index ops took 5-22 ms a 4,096-token step on
    # the H200 host (BENCHMARKS.md, "(a)'s prefill steps on the CPU's thread pool")
    row = torch.repeat_interleave(torch.arange(rows, device=device), lens, output_size=total)
    positions = torch.arange(total, device=device) - cu_dev[row] + first_dev[row]
    slots = tables[row, positions // block_size].long() * block_size + positions % block_size
    nd = next((i for i, n in enumerate(num_new) if n != 1), rows)  # leading one-token rows: the decode kernel's
    context = first_dev.to(torch.int32)
    meta = AttentionMetadata(query_len=0, slot_mapping=slots, block_tables=tables, cu_seqlens_q=cu_dev.to(torch.int32),
                             context_lens=context, max_seqlen_q=max(num_new[nd:], default=1), num_decodes=nd,
                             seq_lens=context[:nd] + 1)
    keep = picked if picked is not None else None if all_logits else cu_dev[1:] - 1
    return StepContext(input_ids if input_ids is not None else host[3 * rows + 1:], tables, 0, positions, meta, keep,
                       starts[:-1])
