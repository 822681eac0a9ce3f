"""Proposers of draft tokens for speculative decoding, behind one interface.

A proposer sees each row's history (prompt and every token emitted so far, host ints) and returns for each row up to
``k`` draft tokens (host lists), or exactly ``k`` for every row as a ``(rows, k)`` tensor on the model's device, which
verification takes as its inputs without waiting for it. Verification keeps only drafts the target itself would have
emitted, so a proposer affects speed, never the output.
"""

from __future__ import annotations

import torch

from ..engine.host_read import HostRead
from .draft import catch_up, draft_greedy, note_drafts
from .ngram import propose_ngram


class NgramProposer:
    """Prompt lookup: the tokens after the latest earlier occurrence of the row's last ``max_ngram`` .. ``min_ngram``
    tokens (:func:`~llmplug.spec.ngram.propose_ngram`); rows without a match get no drafts."""

    def __init__(self, max_ngram: int = 2, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, rows: list[int], histories: list[list[int]], k: int) -> list[list[int]]:
        """Drafts for ``rows`` (indices into ``histories``): one list of at most ``k`` ids per row."""
        return [propose_ngram(torch.tensor(histories[r]), k, self.max_ngram, self.min_ngram).tolist() for r in rows]

    def release(self) -> None:
        """Nothing to give back."""


class DraftModelProposer:
    """A smaller causal LM with the target's tokenizer, greedy, on llmplug with its own paged KV.

    Each row's draft KV follows the row's history: before proposing, the row keeps the KV of the longest prefix its
    last proposal and the history share (accepted drafts keep theirs), feeds the rest in one step, then runs ``k - 1``
    decode steps (:mod:`llmplug.spec.draft`, shared with the Engine). The drafts stay on the device for the verify
    step to take as its inputs; the host learns them from a copy it reads on the next call, when the device has long
    made them, so a speculative step waits for the device once.

    Args:
        batch: the draft's :class:`~llmplug.engine.sequences.SequenceBatch` over the same prompts, not prefilled yet
            (its pages sized for every position a row can reach).
    """

    def __init__(self, batch) -> None:
        self.batch = batch
        self._fed: tuple[list, HostRead] | None = None  # the last drafts' rows and their copy, noted on the next call
        batch.prefill()  # the prompts, in chunks of max_prefill_tokens

    def propose(self, rows: list[int], histories: list[list[int]], k: int) -> torch.Tensor:
        """Greedy drafts of the draft model -> ``(len(rows), k)`` ids on the model's device."""
        self._note_fed()
        batch = self.batch
        seqs = [batch.seqs[r] for r in rows]
        for r, seq in zip(rows, seqs):
            catch_up(seq, histories[r])
        batch._grow(rows, [s.num_tokens + k - 1 for s in seqs])
        drafts = draft_greedy(batch.runner, seqs, [k] * len(seqs), batch.block_size, batch.device,
                              block_tables=batch.tables(rows), read=False)
        self._fed = (seqs, HostRead(drafts))
        return drafts

    def _note_fed(self) -> None:
        if self._fed is not None:
            seqs, read = self._fed
            note_drafts(seqs, read.values())
            self._fed = None

    def release(self) -> None:
        """Give the draft's pages back."""
        self._fed = None
        self.batch.release()
