"""The Engine's greedy ring: while the whole running batch is plain greedy decoding, one step runs a block of decode
steps and the host reads their tokens once.

A block qualifies when nothing else could run or change: nothing waiting, swapped or just submitted, no speculating
request, and every running sequence is a one-token decode of a greedy request without penalties, stop strings or an
unmet ``min_new_tokens`` (its samples forked already). It runs ``n`` steps: at most ``EngineConfig.greedy_ring``, the
most tokens any row may still generate (``max_new_tokens``, ``max_model_len``) and what the free pages hold for all
rows (reserved up front, never by preempting anyone); below two steps the engine steps as usual. A row with fewer
tokens left computes only those: the device sets its position to -1 when it reaches its length (a padding row from
then on: it stores and attends nothing), and the host retires it at launch. On CUDA each step is one
replay of the runner's greedy graph (:meth:`~llmplug.engine.runner.ModelRunner.greedy_graph`: the step, the argmax and
the token fed back, on the device); elsewhere the same steps run eagerly with
:func:`~llmplug.ops.greedy_step.greedy_step` between them. Either way the host reads the block's ``(rows, n)`` tokens
once, and only after the next block is launched: while no other row joins, a block starts from the last one's tokens
on the device (:class:`RingBlock` is the engine's step in flight, as a plain step is; rows retired meanwhile drop out),
so the GPU does not idle on the read. A row that stops on a token in a block thus has the next block computed for it
too, then dropped.

Stop tokens are checked on the host, token by token in order, after the block: rows have different stop sets, so the
device stops nothing (its check takes one set for all rows). A row that stops mid-block keeps its tokens up to the stop
and finishes there (its pages go back; the KV computed past the stop is never read or cached); the rest of its block
is dropped. A streaming request rides the ring too: it gets the same one-token deltas as without it, all of a block's
at once when the block ends (and its tokens share one time in ``token_times``).
"""

from __future__ import annotations

import time

import torch

from ..ops.greedy_step import greedy_step
from .pending import PendingStep
from .request import RequestOutput, Sequence, Status
from .scheduler import longest_first
from .step import build_step, to_device


def _plain_greedy(seq: Sequence) -> bool:
    """A running one-token decode whose next tokens are the argmax alone and need no per-token text check."""
    p = seq.request.params
    return (seq.num_tokens - seq.num_computed == 1 and p.greedy and not p.penalised and not p.stop
            and seq.num_output >= p.min_new_tokens and len(seq.request.seqs) == p.n)


def _room(seq: Sequence, longest: int) -> int:
    """Tokens ``seq`` may still generate (``max_new_tokens``; ``longest``: the model's length limit)."""
    return min(seq.request.params.max_new_tokens - seq.num_output, longest - seq.num_tokens)


class RingBlock(PendingStep):
    """A launched block of greedy decode steps of ``seqs``, whose tokens the host has not seen yet: row ``i`` computes
    ``counts[i]`` of them, its placeholders starting at its token ``indices[i]``. ``tokens (R,)`` holds each row's last
    token on the device: the next block's input, or a plain step's.

    Args:
        ring: ``(R, >= max(counts))`` int64, row ``i``'s tokens in its first ``counts[i]`` columns; copied to the host
            now (queued).
        tokens: ``(R,)`` int64 on the device, copied now (the buffer it comes from moves on).
    """

    def __init__(self, seqs: list[Sequence], indices: list[int], counts: list[int], ring: torch.Tensor,
                 tokens: torch.Tensor) -> None:
        super().__init__(seqs, indices, ring)
        self.counts = counts
        self.tokens = tokens.clone()

    def last_index(self, row: int) -> int:
        return self.indices[row] + self.counts[row] - 1

    def values(self) -> list[list[int]]:
        """Each row's ``counts[i]`` tokens."""
        return [row[:c] for row, c in zip(self.read.values(), self.counts)]


class EngineRing:
    """Blocks of greedy decode steps for one :class:`~llmplug.engine.engine.Engine` (module docstring); the engine's
    metrics count them (``ring_blocks``, ``ring_steps``)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def size(self) -> int:
        """Steps a block may run now from what the host knows (0: none); pages are not looked at yet. Placeholder
        tokens of a step in flight count as generated, so the answer holds once they are resolved (unless a row stops
        at one: :meth:`run` looks again)."""
        engine = self.engine
        sched = engine.scheduler
        if (engine.config.greedy_ring < 2 or not sched.running or sched.waiting or sched.swapped or engine._inbox
                or engine._aborts or len(sched.running) > engine.config.max_num_batched_tokens
                or engine.speculation.active()):
            return 0
        longest, most = engine.runner.max_model_len, 0
        for seq in sched.running:
            if not _plain_greedy(seq):
                return 0
            most = max(most, _room(seq, longest))
        n = min(engine.config.greedy_ring, most)
        return n if n >= 2 else 0

    def continues(self, pending: PendingStep) -> bool:
        """Whether the next block may start from ``pending`` unread: a block whose rows include every running one."""
        return isinstance(pending, RingBlock) and all(id(s) in pending.row_of for s in self.engine.scheduler.running)

    def run(self, finished: list[RequestOutput]) -> bool:
        """Launch one block if the running batch qualifies, then read the block before it, if one is in flight (the
        engine resolved any other step first); False when the batch does not qualify, or when the free pages do not
        hold two more tokens of every row (fewer of a row with fewer left; nothing changed then)."""
        engine = self.engine
        n = self.size()
        # None, or a block of these rows and those retired since (the engine read anything else in flight); rows keep
        # its order: they all advance alike, so it stays longest context first (the decode attention kernel starts its
        # programs in row order, see the scheduler)
        previous = engine._inflight[-1] if engine._inflight else None
        if previous is not None:
            running = {id(s) for s in engine.scheduler.running}
            kept = [r for r, s in enumerate(previous.seqs) if id(s) in running]
            seqs = [previous.seqs[r] for r in kept]
        else:
            kept, seqs = [], longest_first(engine.scheduler.running)
        rooms = [_room(s, engine.runner.max_model_len) for s in seqs]
        if n:
            n = engine.scheduler.reserve(seqs, n, rooms, least=2)
        if not n:
            return False
        engine.metrics.on_ring(n, engine.blocks)
        try:
            engine._inflight.append(self._launch(seqs, [min(n, r) for r in rooms], n, previous, kept))
        except Exception as error:  # a failed block fails its requests; the engine keeps serving the others
            engine.blocks.reset_cache()
            for seq in seqs:
                engine._fail(seq.request, error, finished)
        if previous is not None:  # its rows retired since, too, finish with it
            engine._resolve(finished, keep=len(engine._inflight) - 1)
        return True

    def resolve(self, block: RingBlock, finished: list[RequestOutput]) -> None:
        """Wait for ``block``'s tokens, put them in place and check each row's stops, token by token."""
        engine = self.engine
        now = time.perf_counter()
        for seq, start, row in zip(block.seqs, block.indices, block.values()):
            if seq.status is Status.FINISHED:  # stopped in an earlier block, or aborted: these tokens are dropped
                continue
            n = len(row)
            seq.tokens[start:start + n] = row
            if not seq.request.stream and seq.request.stop_ids.isdisjoint(row[:-1]):
                # no token before the last can end the row (n is within its length limits): all at once
                seq.resolved = start + n - 1
                seq.token_times.extend([now] * (n - 1))
                engine.metrics.output_tokens += n - 1
                row, start = row[-1:], start + n - 1
            for j, token in enumerate(row):
                seq.resolved = start + j + 1
                engine.metrics.output_tokens += 1
                seq.register_full_blocks(engine.blocks)
                engine._check_stop(seq, token, now, finished)
                if seq.status is Status.FINISHED:  # tokens after the stop are dropped (_finish cut them)
                    break

    def _launch(self, seqs: list[Sequence], counts: list[int], n: int, previous: RingBlock | None,
                kept: list[int]) -> RingBlock:
        """``n`` greedy decode steps of ``seqs`` (their pages reserved; row ``i`` computes ``counts[i] <= n``), from
        their known last tokens or from ``previous``'s rows ``kept`` on the device -> the block in flight; each row
        gets its placeholders and its ``num_computed`` advances by its count; a row that reaches its length limit is
        retired (nothing more is scheduled for it)."""
        engine = self.engine
        runner = engine.runner
        dev, rows = runner.device, len(seqs)
        tables = engine.page_table.rows([s.blocks for s in seqs])
        firsts = [s.num_computed for s in seqs]
        # one copy: positions, the positions where rows stop, and the last tokens (known ones, or previous's rows)
        host = torch.tensor(firsts + [f + c for f, c in zip(firsts, counts)]
                            + (kept if previous is not None else [s.tokens[-1] for s in seqs]))
        host = to_device(host, dev)
        positions, limits = host[:rows], host[rows:2 * rows]
        if previous is None:
            ids = host[2 * rows:]
        else:
            ids = previous.tokens if rows == len(previous.seqs) else previous.tokens[host[2 * rows:]]
        graph_buf = runner.greedy_graph(rows)
        if graph_buf is not None:
            graph, buf = graph_buf
            # no stop on the device but lengths: the host checks each row's own stop ids
            runner.arm_token_loop(buf, ids, positions, tables, True, torch.empty(0, dtype=torch.long), 0, limits)
            for _ in range(n):
                graph.replay()
            ring, ids = buf["ring"][:rows], buf["input_ids"][:rows]
        else:  # ids and positions advance in place (a previous block's ids are its own copy, unread after this)
            ring = torch.zeros((rows, n), dtype=torch.long, device=dev)
            unfinished = torch.ones(rows, dtype=torch.bool, device=dev)
            no_eos = torch.full((1,), -1, dtype=torch.long, device=dev)
            pad = torch.zeros(1, dtype=torch.long, device=dev)
            counters = torch.zeros(2, dtype=torch.long, device=dev)
            for _ in range(n):
                ctx = build_step(seqs, [1] * rows, engine.block_size, dev, input_ids=ids, block_tables=tables,
                                 positions=positions)
                logits = runner.step(ctx)
                greedy_step(logits, unfinished, no_eos, pad, ring, ids, positions, limits, counters)
        for seq, c in zip(seqs, counts):
            seq.num_computed += c
        return RingBlock(seqs, engine._hold_places(seqs, counts), counts, ring, ids)
