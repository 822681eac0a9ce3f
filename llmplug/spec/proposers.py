"""Proposers of draft tokens for speculative decoding, behind one interface.

A proposer sees each row's history (prompt and every token emitted so far, host ints) and returns up to ``k`` draft
tokens for some of the rows. Verification keeps only drafts the target itself would have emitted, so a proposer
affects speed, never the output.
"""

from __future__ import annotations

import torch

from .draft import catch_up, draft_greedy
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
    decode steps whose tokens stay on the device until the drafts are read once (:mod:`llmplug.spec.draft`, shared
    with the Engine).

    Args:
        batch: the draft's :class:`~llmplug.engine.sequences.SequenceBatch` over the same prompts, not prefilled yet
            (its pages sized for every position a row can reach).
    """

    def __init__(self, batch) -> None:
        self.batch = batch
        batch.prefill()  # the prompts, in chunks of max_prefill_tokens

    def propose(self, rows: list[int], histories: list[list[int]], k: int) -> list[list[int]]:
        """Greedy drafts of the draft model: ``k`` ids for each of ``rows``."""
        batch = self.batch
        seqs = [batch.seqs[r] for r in rows]
        for r, seq in zip(rows, seqs):
            catch_up(seq, histories[r])
        batch._grow(rows, [s.num_tokens + k - 1 for s in seqs])
        return draft_greedy(batch.runner, seqs, [k] * len(seqs), batch.block_size, batch.device,
                            block_tables=batch.tables(rows))

    def release(self) -> None:
        """Give the draft's pages back."""
        self.batch.release()
