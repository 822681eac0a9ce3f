"""Speculative decoding of ``generate``'s rows: propose, verify ``1 + k`` tokens a row in one step, accept.

Each step takes every row that still needs tokens, asks the proposer for drafts, and verifies them in one uniform
step (:func:`~llmplug.engine.step.build_step`, a CUDA graph per (rows bucket, ``1 + k``)). Greedy: a row keeps its
drafts while they equal the target's argmax, then the target's own token, so the tokens are exactly greedy
decoding's. Sampling: exact rejection sampling against the target's distribution after every sampling option. A
row's rejected drafts are never counted as computed, so the next step overwrites their KV slots. Rows advance by
different amounts; HF's stop bookkeeping (:class:`~llmplug.engine.late_stops.LateStops`) runs over the columns every
row has reached.
"""

from __future__ import annotations

import torch

from ..engine.late_stops import LateStops
from ..engine.runner import GREEDY_RING
from ..engine.step import build_step, to_device
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
            or anything with their ``propose``.
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
    rows = len(seqs)
    pending: list[list[int]] = [[] for _ in range(rows)]  # emitted, not yet fed to ``stops``
    produced = [0] * rows
    ended = [False] * rows  # emitted an eos that HF will pad after
    stats = SpecStats(per_row_steps=[0] * rows, per_row_emitted=[0] * rows)
    device = seqs.device
    while not stops.done:
        # rows that still need tokens (without an eos criterion HF keeps finished rows' real tokens: they go on)
        active = [r for r in range(rows) if produced[r] < steps and not ended[r]
                  and (not stops.has_eos or bool(stops.unfinished[r]))]
        if active:
            k = min(policy.choose(len(active)), max(steps - produced[r] - 1 for r in active))
            if k > 0:
                _verify_step(seqs, proposer, policy, k, histories, active, steps, produced, pending, ended, eos,
                             stats, device, stops.has_eos, sample)
            else:
                _plain_steps(seqs, policy.probe_every, histories, active, steps, produced, pending, ended, eos,
                             stats, device, stops.has_eos, sample)
        # feed the columns every row has: a row that needs nothing more is padded (HF pads or cuts it anyway)
        waiting = [len(pending[r]) for r in active if produced[r] < steps and not ended[r]]
        width = min(waiting) if waiting else max(map(len, pending))
        if width == 0:
            if not active:
                raise RuntimeError("speculative decoding stalled: no row needs tokens but generation has not ended")
            continue
        chunk = torch.tensor([(p + [stops.pad] * width)[:width] for p in pending], dtype=torch.long)
        for r in range(rows):
            del pending[r][:width]
        stops.feed(chunk)
    return stats


def _plain_steps(seqs, n, histories, active, steps, produced, pending, ended, eos, stats, device, has_eos,
                 sample) -> None:
    """Up to ``n`` decode steps of the ``active`` rows without drafts: greedy on CUDA ``n`` replays of the greedy
    graph (tokens fed back on the device, read once at the end), otherwise one step at a time."""
    n = min(n, GREEDY_RING, min(steps - produced[r] for r in active))  # no row computes past its limit
    sub = [seqs.seqs[r] for r in active]
    graph_buf = seqs.runner.greedy_graph(len(active)) if sample is None else None
    if graph_buf is None:
        for _ in range(n):
            _verify_step(seqs, None, None, 0, histories, active, steps, produced, pending, ended, eos, stats, device,
                         has_eos, sample)
        return
    graph, buf = graph_buf
    rows = len(active)
    seqs._grow(active, [s.num_computed + n for s in sub])
    tables = seqs.block_table_dev[active] if rows < len(seqs) else seqs.block_table_dev
    host = torch.tensor([[histories[r][-1] for r in active], [s.num_computed for s in sub]], dtype=torch.long)
    first = to_device(host, device)
    buf["input_ids"][:rows].copy_(first[0])
    buf["positions"].fill_(-1)
    buf["positions"][:rows].copy_(first[1])
    buf["unfinished"].fill_(True)  # stops are HF's bookkeeping's business, on the host
    buf["eos"].fill_(-1)
    buf["counters"].zero_()
    buf["block_tables"][:rows, :tables.shape[1]].copy_(tables)
    for _ in range(n):
        graph.replay()
    ring = buf["ring"][:rows, :n].tolist()
    stats.steps += n
    for r, seq, row_tokens in zip(active, sub, ring):
        seq.num_computed += n
        _emit(r, row_tokens, 0, n, steps, produced, histories, pending, ended, eos, stats, has_eos)


def _emit(r, row_tokens, drafted, steps_taken, steps, produced, histories, pending, ended, eos, stats,
          has_eos) -> None:
    new = row_tokens[:steps - produced[r]]
    histories[r].extend(new)
    pending[r].extend(new)
    produced[r] += len(new)
    ended[r] = ended[r] or (has_eos and any(t in eos for t in new))
    stats.drafted += drafted
    stats.emitted += len(new)
    stats.per_row_steps[r] += steps_taken
    stats.per_row_emitted[r] += len(new)


def _verify_step(seqs, proposer, policy, k, histories, active, steps, produced, pending, ended, eos, stats, device,
                 has_eos, sample) -> None:
    drafts = proposer.propose(active, histories, k) if k > 0 else [[] for _ in active]
    drafts = [d[:max(0, min(k, steps - produced[r] - 1))] for r, d in zip(active, drafts)]
    q = 1 + max(map(len, drafts))
    filler = [d + [histories[r][-1]] * (q - 1 - len(d)) for r, d in zip(active, drafts)]  # verified like drafts
    ids = torch.tensor([[histories[r][-1]] + f for r, f in zip(active, filler)], dtype=torch.long)
    sub = [seqs.seqs[r] for r in active]
    seqs._grow(active, [s.num_computed + q for s in sub])
    tables = seqs.block_table_dev[active] if len(active) < len(seqs) else seqs.block_table_dev
    ctx = build_step(sub, [q] * len(sub), seqs.block_size, device, input_ids=ids.reshape(-1), block_tables=tables,
                     all_logits=True)
    logits = seqs.runner.step(ctx).view(len(active), q, -1)
    counts = torch.tensor([len(d) for d in drafts], device=device)
    drafted = ctx.input_ids.view(len(active), q)[:, 1:]
    if sample is None:
        tokens, emitted = greedy_accept(logits, drafted, counts)
    else:
        probs = sample(logits.reshape(len(active) * q, -1)).view(len(active), q, -1)
        tokens, emitted = rejection_sample(probs, drafted, counts)
    both = torch.cat([tokens, emitted[:, None]], dim=1).tolist()  # one read of the device
    tokens, emitted = [row[:-1] for row in both], [row[-1] for row in both]
    if policy is not None:
        policy.record(sum(len(d) for d in drafts), sum(n - 1 for n in emitted))
    stats.steps += 1
    for r, seq, row_tokens, n, d in zip(active, sub, tokens, emitted, drafts):
        seq.num_computed += n  # the last token and the accepted drafts; the rest's KV slots are free again
        stats.accepted += n - 1
        _emit(r, row_tokens[:n], len(d), 1, steps, produced, histories, pending, ended, eos, stats, has_eos)
