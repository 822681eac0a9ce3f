"""What one forward pass needs to know about its tokens, beyond ids and positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Paged-attention inputs for one step; every tensor is on the model's device.

    Packed (``query_len`` 0): sequences packed without padding, some possibly continuing from cached context.
    Uniform (``query_len`` Q > 0): ``Q`` new tokens per sequence, ``T == B * Q``; a decode step (``is_decode``) is
    ``Q == 1``.

    Attributes:
        query_len: ``Q`` of a uniform step, 0 for a packed one.
        slot_mapping: ``(T,) int64`` KV slot of each new token (< 0: write nothing).
        block_tables: ``(B, M) int32`` page ids of each sequence.
        cu_seqlens_q: ``(B+1,) int32`` not decode: row offsets of each sequence's new tokens.
        context_lens: ``(B,) int32`` not decode: tokens already cached before this step.
        max_seqlen_q: not decode: longest new-token run.
        seq_lens: ``(B,) int32`` decode: cached tokens including the new one (0: padding row).
        num_decodes: packed only: the first ``num_decodes`` sequences have one new token each; their attention runs
            on the decode kernel (``seq_lens`` then holds their ``(num_decodes,)`` lengths), the rest on the prefill
            kernel.
        token_seq_lens, token_block_tables: uniform steps of a few tokens a row (speculative verifies): ``(T,)
            int32`` each token's causal length (its position + 1; 0 on padding rows) and ``(T, M) int32`` its row's
            pages, so the decode kernel attends for every token; None otherwise (the prefill kernel).
        num_splits: the decode kernel's split count in a packed step (0: chosen from the shapes; warm-up sets each).
    """

    query_len: int
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    max_seqlen_q: int = 0
    seq_lens: torch.Tensor | None = None
    num_decodes: int = 0
    token_seq_lens: torch.Tensor | None = None
    token_block_tables: torch.Tensor | None = None
    num_splits: int = 0

    @property
    def is_decode(self) -> bool:
        return self.query_len == 1
