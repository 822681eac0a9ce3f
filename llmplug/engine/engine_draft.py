"""The Engine's draft-model speculation (``SpeculativeConfig(method="draft", draft_model=...)``): one
:class:`EngineDrafter` per draft model, holding draft KV for every running sequence that speculates with it.

A draft model is an HF causal LM with the target's tokenizer, put on llmplug with its own runner and paged KV pool.
For each target sequence it drafts for, the drafter keeps a draft-side sequence (its tokens, computed length and pages
in the draft's pool). Each speculative step, every such row is rolled back to the longest prefix its draft tokens share
with the target's (accepted drafts keep their KV, rejected ones are dropped), then all rows are drafted together
(:func:`~llmplug.spec.draft.draft_greedy`: one catch-up step with per-row lengths, ``k - 1`` decode steps, one read).
The drafts are greedy (a one-hot ``q``), so sampled requests verify them by the same exact rejection sampling as
prompt lookup's.

Never at the target's expense: a row whose draft pages the draft's pool cannot give this step, or whose catch-up does
not fit the step's catch-up budget (a long prompt is caught up over several steps, in chunks), just gets no drafts;
nothing is preempted for the draft. A sequence's draft pages go back when it finishes, is aborted, fails or is
preempted (a preempted one recomputes its draft KV from its tokens when it drafts again); each sample of an ``n > 1``
request drafts on its own after the fork. Its GPU speed is not measured yet.
"""

from __future__ import annotations

import torch

from ..spec.draft import catch_up, draft_greedy
from ..state import ensure_state
from .request import Sequence


class _DraftSeq:
    """A target sequence's draft side: ``tokens`` (the target's known ones, then drafts the draft fed itself), of which
    ``num_computed`` have KV in ``blocks`` (pages of the draft's pool) and the first ``resolved`` are the target's."""

    __slots__ = ("tokens", "num_computed", "blocks", "resolved")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.num_computed = 0
        self.blocks: list[int] = []
        self.resolved = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class EngineDrafter:
    """One draft model's side of an engine: its runner and pool, and a :class:`_DraftSeq` per target sequence.

    Args:
        model: the draft model (checked already: same tokenizer as the target, not the target itself).
        budget: most tokens one catch-up step feeds (the engine's ``max_num_batched_tokens``; the draft's own
            ``max_prefill_tokens`` if lower).
    """

    def __init__(self, model: torch.nn.Module, budget: int) -> None:
        self.state = ensure_state(model)
        self.runner = self.state.runner
        cache = self.runner.ensure_cache()
        self.blocks, self.block_size = cache.blocks, cache.block_size
        self.budget = min(budget, self.runner.config.max_prefill_tokens)
        self.rows: dict[Sequence, _DraftSeq] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Greedy drafts, ``ks[i]`` for ``seqs[i]`` (every token of each known to the host), or ``[]`` for a row that
        gets none this step (draft pool short, catch-up budget spent, past the draft's ``max_model_len``)."""
        with self.state.step_lock:  # no generate call on the draft model drives its runner meanwhile
            return self._propose(seqs, ks)

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        limit = self.runner.max_model_len
        rows = []  # (index, its draft side, k)
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            k = min(k, limit - seq.num_tokens + 1)  # the last draft is never fed: positions up to num_tokens + k - 2
            if k < 1:
                continue
            row = self.rows.get(seq)
            if row is None:
                row = self.rows[seq] = _DraftSeq()
            catch_up(row, seq.tokens)
            rows.append((i, row, k))
        rows.sort(key=lambda r: r[1].num_tokens - r[1].num_computed)  # the budget goes to short catch-ups first
        left, picked, takes = self.budget, [], []
        for i, row, k in rows:
            missing = row.num_tokens - row.num_computed
            take = min(missing, left)
            if take == 0:
                break
            if take < missing:
                k = 0  # a chunk of a long catch-up, no drafts yet
            need = -(-(row.num_computed + take + max(k - 1, 0)) // self.block_size) - len(row.blocks)
            if need > self.blocks.num_free:
                continue
            if need > 0:
                row.blocks.extend(self.blocks.allocate(need))
            left -= take
            picked.append((i, row, k))
            takes.append(take)
        out: list[list[int]] = [[] for _ in seqs]
        if picked:
            drafts = draft_greedy(self.runner, [row for _, row, _ in picked], [k for _, _, k in picked],
                                  self.block_size, self.runner.device, num_new=takes)
            for (i, _, _), d in zip(picked, drafts):
                out[i] = d
        return out

    def release(self, seq: Sequence) -> None:
        """Give back ``seq``'s draft pages (it finished, was aborted, failed or was preempted)."""
        row = self.rows.pop(seq, None)
        if row is not None and row.blocks:
            with self.state.step_lock:
                self.blocks.free(row.blocks)
