"""The Engine's EAGLE-3 speculation (``SpeculativeConfig(method="eagle3", head=llmplug.load_eagle3(dir, model))``):
one :class:`EngineEagle` per head, drafting for every running sequence that speculates with it.

The head reads the model's inputs of a few layers at every position of a sequence (the runner captures them at every
step while such a request lives, :meth:`~llmplug.engine.runner.ModelRunner.capture_aux`). Each step the engine hands
over, per sequence, the captured states of the positions it now knows for good: a prefill chunk's tokens, a plain
decode step's token, a verify step's last token and accepted drafts (:meth:`EngineEagle.observe`). A sequence gets a
row of the head's proposer (:class:`~llmplug.spec.eagle3.Eagle3Proposer`) once its states start at position 0 and
drafts while they cover every position but its last token's. Where they cannot (its prompt came partly from the prefix
cache, or a step ran without the capture) it goes without drafts; when it gives up its KV (finished, aborted, failed,
preempted) its row is dropped, and a recomputed sequence starts a new one. Its GPU speed is not measured yet.
"""

from __future__ import annotations

import torch

from .request import Sequence


class EngineEagle:
    """Drafts from one EAGLE-3 head for the Engine's sequences (module docstring).

    Args:
        head: the proposer ``llmplug.load_eagle3`` gave for the engine's model.
        runner: the engine's model runner (it captures ``head.aux_layers`` from now on).
    """

    def __init__(self, head, runner) -> None:
        self.head, self.runner = head, runner
        self.rows: dict[Sequence, int] = {}  # a sequence's row in the head's proposer
        self.seen: dict[Sequence, int] = {}  # positions whose states the head got, per sequence with a row
        self.lost: set[Sequence] = set()  # sequences whose states have a gap: no drafts until they give up their KV
        self._free: list[int] = []
        self.capture()

    def capture(self) -> None:
        """Make the next step capture the head's layer inputs (a ``generate`` call on the model may have changed what
        the runner captures)."""
        if self.runner.aux_layers != tuple(self.head.aux_layers):
            self.runner.capture_aux(tuple(self.head.aux_layers))

    def observe(self, seq: Sequence, first: int, states: torch.Tensor | None) -> None:
        """``states (n, A)``: the captured layer inputs of ``seq``'s positions ``first .. first + n - 1``, all known for
        good (None: the step captured nothing)."""
        if seq in self.lost:
            return
        row = self.rows.get(seq)
        if row is None and first == 0 and states is not None:
            row = self.rows[seq] = self._free.pop() if self._free else len(self.rows) + len(self._free)
            self.seen[seq] = 0
        if row is None or states is None or first != self.seen[seq]:
            self._drop(seq)
            self.lost.add(seq)
            return
        self.head.observe([row], [states])
        self.seen[seq] += states.shape[0]

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Greedy drafts, ``ks[i]`` for ``seqs[i]``, or ``[]`` for a sequence whose states do not cover every position
        but its last token's."""
        ready = [i for i, s in enumerate(seqs) if s in self.rows and self.seen[s] == s.num_tokens - 1]
        out: list[list[int]] = [[] for _ in seqs]
        if ready:
            rows = [self.rows[seqs[i]] for i in ready]
            drafts = self.head.propose(rows, {self.rows[seqs[i]]: seqs[i].tokens for i in ready},
                                       max(ks[i] for i in ready))
            for i, d in zip(ready, drafts):
                out[i] = d[:ks[i]]
        return out

    def release(self, seq: Sequence) -> None:
        """``seq`` gave up its KV: its row goes (a recomputed sequence starts a new one)."""
        self._drop(seq)
        self.lost.discard(seq)

    def _drop(self, seq: Sequence) -> None:
        row = self.rows.pop(seq, None)
        self.seen.pop(seq, None)
        if row is not None:
            self.head.forget(row)
            self._free.append(row)
