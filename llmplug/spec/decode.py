"""Speculative decoding of ``generate``'s rows: propose, verify ``1 + k`` tokens a row in one step, accept.

Each step takes every row that still needs tokens, asks the proposer for drafts, and verifies them in one uniform
step (:func:`~llmplug.engine.step.build_step`, a CUDA graph per (rows bucket, ``1 + k``); greedy on CUDA, the graph
also accepts, :meth:`~llmplug.engine.runner.ModelRunner.greedy_verify`). Greedy: a row keeps its
drafts while they equal the target's argmax, then the target's own token, so the tokens are exactly greedy
decoding's. Sampling: exact rejection sampling against the target's distribution after every sampling option. A
row's rejected drafts are never counted as computed, so the next step overwrites their KV slots. Rows advance by
different amounts; HF's stop bookkeeping (:class:`~llmplug.engine.late_stops.LateStops`) runs over the columns every
row has reached.
"""

from __future__ import annotations

import time

import torch

from ..engine.late_stops import LateStops
from ..engine.runner import GREEDY_RING
from ..engine.step import build_step
from .adaptive import AdaptiveK
from .rejection import greedy_accept, rejection_sample
from .stats import SpecStats


def speculative_decode(seqs, proposer, policy: AdaptiveK, histories: list[list[int]], stops: LateStops,
                       steps: int, eos: set[int], sample=None) -> SpecStats:
    """Decode with speculation until ``stops`` says generation ended: greedily, or sampling with ``sample``.

    Args:
        seqs: the call's :class:`~llmplug.engine.sequences.SequenceBatch`, every row's KV computed up to (not
            including) its last emitted token, pages sized for ``steps + policy.k_max`` more positions.
        proposer: :class:`~llmplug.spec.proposers.NgramProposer`, :class:`~llmplug.spec.proposers.DraftModelProposer`
            or anything with their ``propose`` (drafts as host lists, or ``(rows, k)`` on the device). One with
            ``aux_layers`` and ``observe(rows, aux)`` (an EAGLE-3 head, :class:`~llmplug.spec.eagle3.Eagle3Proposer`)
            gets after each step the target's inputs of those layers at every position the step verified
            (``aux[i] (n_i, A)`` for row ``rows[i]``; the runner captures them,
            :meth:`~llmplug.engine.runner.ModelRunner.capture_aux`); its plain steps then run one at a time.
        policy: chooses each step's draft count.
        histories: per row its prompt and emitted tokens (host ints; extended in place).
        stops: HF's bookkeeping from the row state after the last emitted token.
        steps: most new tokens a row may get (the max-length limit).
        eos: end-of-sequence ids (a row that emitted one needs no more tokens when HF pads finished rows).
        sample: None for greedy; else ``logits (N, V) -> probabilities (N, V)`` after every sampling option, and
            drafts are verified by exact rejection sampling (:func:`~llmplug.spec.rejection.rejection_sample`; the
            proposers' drafts are deterministic, a one-hot ``q``).

    Returns:
        The call's :class:`SpecStats`; the kept tokens are in ``stops``.
    """
    observe = proposer.observe if getattr(proposer, "aux_layers", None) else None
    rows = _Rows(seqs, histories, steps, eos, stops.has_eos, observe)
    while not stops.done:
        active = rows.active(stops)  # HF's criteria have seen every step but the last one here
        collect = None
        if active:
            k = min(policy.choose(len(active)), max(steps - rows.produced[r] - 1 for r in active))
            start = time.perf_counter()  # both paths end on a read of the device: wall time is the step's cost
            if k > 0:
                collect = rows.verify(active, proposer.propose(active, histories, k), policy, sample)
            else:
                n = rows.plain(active, policy.probe_every, sample)
                policy.record_cost(len(active), 1, (time.perf_counter() - start) / n)
        fed = rows.feed(active, stops)  # the earlier steps' tokens, while the device runs the verify step
        if collect is not None:
            policy.record_cost(len(active), collect(), time.perf_counter() - start)
        if not fed and not active:
            raise RuntimeError("speculative decoding stalled: no row needs tokens but generation has not ended")
    return rows.stats


class _Rows:
    """The rows of one speculative call: their histories, the tokens not yet fed to HF's stop bookkeeping, how many
    each produced, which ended on an eos; and the steps that advance them (telling ``observe``, when given, the
    target's captured states of the positions each step verified)."""

    def __init__(self, seqs, histories: list[list[int]], steps: int, eos: set[int], has_eos: bool,
                 observe=None) -> None:
        self.seqs, self.histories, self.steps, self.eos, self.has_eos = seqs, histories, steps, eos, has_eos
        self.observe = observe
        count = len(seqs)
        self.pending: list[list[int]] = [[] for _ in range(count)]  # emitted, not yet fed to the stops
        self.produced = [0] * count
        self.ended = [False] * count  # emitted an eos that HF will pad after
        self.stats = SpecStats(per_row_steps=[0] * count, per_row_emitted=[0] * count)

    def _needs(self, r: int) -> bool:
        return self.produced[r] < self.steps and not self.ended[r]

    def active(self, stops: LateStops) -> list[int]:
        """Rows that still need tokens (without an eos criterion HF keeps finished rows' real tokens: they go on)."""
        return [r for r in range(len(self.seqs))
                if self._needs(r) and (not self.has_eos or bool(stops.unfinished[r]))]

    def feed(self, active: list[int], stops: LateStops) -> bool:
        """Feed ``stops`` the columns every row has (a row needing nothing more is padded: HF pads or cuts it anyway);
        False when there was none."""
        waiting = [len(self.pending[r]) for r in active if self._needs(r)]
        width = min(waiting) if waiting else max(map(len, self.pending))
        if width == 0:
            return False
        chunk = torch.tensor([(p + [stops.pad] * width)[:width] for p in self.pending], dtype=torch.long)
        for p in self.pending:
            del p[:width]
        stops.feed(chunk)
        return True

    def _emit(self, r: int, tokens: list[int], drafted: int, steps_taken: int) -> None:
        new = tokens[:self.steps - self.produced[r]]
        self.histories[r].extend(new)
        self.pending[r].extend(new)
        self.produced[r] += len(new)
        self.ended[r] = self.ended[r] or (self.has_eos and any(t in self.eos for t in new))
        self.stats.drafted += drafted
        self.stats.emitted += len(new)
        self.stats.per_row_steps[r] += steps_taken
        self.stats.per_row_emitted[r] += len(new)

    def plain(self, active: list[int], n: int, sample) -> int:
        """Up to ``n`` decode steps of ``active`` without drafts: greedy on CUDA one replay of the greedy graph each,
        read once (:meth:`SequenceBatch.ring`), otherwise (or while ``observe`` wants every step's states) one step at
        a time. Returns how many steps ran."""
        n = min(n, GREEDY_RING, min(self.steps - self.produced[r] for r in active))  # no row past its limit
        ring = None
        if sample is None and self.observe is None:
            ring = self.seqs.ring(active, [self.histories[r][-1] for r in active], n)
        if ring is None:
            for _ in range(n):
                self.verify(active, [[] for _ in active], None, sample)()
            return n
        self.stats.steps += n
        for r, tokens in zip(active, ring):
            self._emit(r, tokens, 0, n)
        return n

    def verify(self, active: list[int], drafts: list[list[int]] | torch.Tensor, policy: AdaptiveK | None, sample):
        """Launch one step over each active row's last token and its drafts (host lists, or ``(rows, k)`` on the
        device; past a row's limit, and in rows with fewer drafts, filler tokens are verified like drafts but never
        accepted) -> ``collect()``, which reads the result (one read of the device), keeps what the target agrees
        with and returns the step's tokens a row. Greedy on CUDA: one replay of the verify graph
        (:meth:`~llmplug.engine.runner.ModelRunner.greedy_verify`)."""
        limits = [max(0, self.steps - self.produced[r] - 1) for r in active]
        lasts = [self.histories[r][-1] for r in active]
        if isinstance(drafts, torch.Tensor):
            counts = [min(drafts.shape[1], n) for n in limits]
            q = 1 + max(counts)
            on_device, ids = drafts[:, :q - 1], [[t] * q for t in lasts]  # the draft columns come from the device
        else:
            drafts = [d[:n] for d, n in zip(drafts, limits)]
            counts = [len(d) for d in drafts]
            q = 1 + max(counts)
            on_device, ids = None, [[t] + d + [t] * (q - 1 - len(d)) for t, d in zip(lasts, drafts)]
        sub = [self.seqs.seqs[r] for r in active]
        self.seqs._grow(active, [s.num_computed + q for s in sub])
        runner = self.seqs.runner
        result = None
        if sample is None:
            result = runner.greedy_verify(ids, [s.num_computed for s in sub], counts, self.seqs.tables(active),
                                          drafts=on_device)
        if result is None:
            result = self._verify_eager(sub, active, ids, counts, on_device, sample)

        def collect() -> int:
            both = result.tolist()
            if policy is not None:
                policy.record(sum(counts), sum(row[-1] - 1 for row in both))
            self.stats.steps += 1
            for r, seq, row, count in zip(active, sub, both, counts):
                n = row[-1]
                seq.num_computed += n  # the last token and the accepted drafts; the rest's KV slots are free again
                self.stats.accepted += n - 1
                self._emit(r, row[:n], count, 1)
            if self.observe is not None:
                aux = runner.aux_hidden.view(len(active), q, -1)
                self.observe(active, [aux[i, :row[-1]] for i, row in enumerate(both)])
            return q

        return collect

    def _verify_eager(self, sub, active: list[int], ids: list[list[int]], counts: list[int],
                      on_device: torch.Tensor | None, sample) -> torch.Tensor:
        """The verify step through ``runner.step`` and the acceptance as separate launches -> ``(rows, q + 1)`` on the
        device: per row its emitted tokens padded with -1, then how many."""
        q, device = len(ids[0]), self.seqs.device
        ctx = build_step(sub, [q] * len(sub), self.seqs.block_size, device,
                         input_ids=torch.tensor(ids, dtype=torch.long).reshape(-1),
                         block_tables=self.seqs.tables(active), all_logits=True)
        drafted = ctx.input_ids.view(len(active), q)[:, 1:]
        if on_device is not None:
            drafted.copy_(on_device)
        logits = self.seqs.runner.step(ctx).view(len(active), q, -1)
        counts = torch.tensor(counts, device=device)
        if sample is None:
            tokens, emitted = greedy_accept(logits, drafted, counts)
        else:
            probs = sample(logits.reshape(len(active) * q, -1)).view(len(active), q, -1)
            tokens, emitted = rejection_sample(probs, drafted, counts)
        return torch.cat([tokens, emitted[:, None]], dim=1)
