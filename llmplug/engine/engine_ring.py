"""The Engine's greedy ring: while the whole running batch is plain greedy decoding, one step runs a block of decode
steps and the host reads their tokens once.

A block qualifies when nothing else could run or change: nothing waiting, swapped or just submitted, no speculating
request, and every running sequence is a one-token decode of a greedy request without penalties, stop strings or an
unmet ``min_new_tokens`` (its samples forked already). It runs ``n`` steps: at most ``EngineConfig.greedy_ring``, the
tokens every row may still generate (``max_new_tokens``, ``max_model_len``) and what the free pages hold for all rows
(reserved up front, never by preempting anyone); below two steps the engine steps as usual. On CUDA each step is one
replay of the runner's greedy graph (:meth:`~llmplug.engine.runner.ModelRunner.greedy_graph`: the step, the argmax and
the token fed back, on the device); elsewhere the same steps run eagerly with
:func:`~llmplug.ops.greedy_step.greedy_step` between them. Either way the host reads the block's ``(rows, n)`` tokens
once.

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
from .request import RequestOutput, Sequence, Status
from .step import build_step, to_device


def _plain_greedy(seq: Sequence) -> bool:
    """A running one-token decode whose next tokens are the argmax alone and need no per-token text check."""
    p = seq.request.params
    return (seq.num_tokens - seq.num_computed == 1 and p.greedy and not p.penalised and not p.stop
            and seq.num_output >= p.min_new_tokens and len(seq.request.seqs) == p.n)


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
        n = engine.config.greedy_ring
        if (n < 2 or not sched.running or sched.waiting or sched.swapped or engine._inbox or engine._aborts
                or len(sched.running) > engine.config.max_num_batched_tokens or engine.speculation.active()):
            return 0
        longest = engine.runner.max_model_len
        for seq in sched.running:
            if not _plain_greedy(seq):
                return 0
            n = min(n, seq.request.params.max_new_tokens - seq.num_output, longest - seq.num_tokens)
        return n if n >= 2 else 0

    def run(self, finished: list[RequestOutput]) -> bool:
        """Run one block if the running batch qualifies (the engine resolved its step in flight first); False when it
        does not, or when the free pages do not hold two more tokens of every row (nothing changed then)."""
        engine = self.engine
        n = self.size()
        seqs = list(engine.scheduler.running)
        if n:
            n = engine.scheduler.reserve(seqs, n, least=2)
        if not n:
            return False
        engine.metrics.on_ring(n, engine.blocks)
        try:
            values = self._decode(seqs, n)
        except Exception as error:  # a failed block fails its requests; the engine keeps serving the others
            engine.blocks.reset_cache()
            for seq in seqs:
                engine._fail(seq.request, error, finished)
            return True
        now = time.perf_counter()
        for seq, row in zip(seqs, values):
            start = seq.num_tokens
            seq.tokens.extend(row)
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
        return True

    def _decode(self, seqs: list[Sequence], n: int) -> list[list[int]]:
        """``n`` greedy decode steps of ``seqs`` (their pages reserved) -> each row's ``n`` tokens, read once; every
        row's ``num_computed`` advances by ``n``."""
        runner = self.engine.runner
        dev, rows = runner.device, len(seqs)
        tables = self.engine.page_table.rows([s.blocks for s in seqs])
        ids, positions = to_device(torch.tensor([[s.tokens[-1] for s in seqs], [s.num_computed for s in seqs]]), dev)
        graph_buf = runner.greedy_graph(rows)
        if graph_buf is not None:
            graph, buf = graph_buf
            # no stop on the device: the host checks each row's own stop ids
            runner.arm_token_loop(buf, ids, positions, tables, True, torch.empty(0, dtype=torch.long), 0)
            for _ in range(n):
                graph.replay()
            for seq in seqs:
                seq.num_computed += n
            return buf["ring"][:rows, :n].tolist()
        ring = torch.zeros((rows, n), dtype=torch.long, device=dev)
        unfinished = torch.ones(rows, dtype=torch.bool, device=dev)
        no_eos = torch.full((1,), -1, dtype=torch.long, device=dev)
        pad = torch.zeros(1, dtype=torch.long, device=dev)
        counters = torch.zeros(2, dtype=torch.long, device=dev)
        for _ in range(n):
            ctx = build_step(seqs, [1] * rows, self.engine.block_size, dev, input_ids=ids, block_tables=tables)
            logits = runner.step(ctx)
            greedy_step(logits, unfinished, no_eos, pad, ring, ids, positions, counters)
            for seq in seqs:
                seq.num_computed += 1
        return ring.tolist()
