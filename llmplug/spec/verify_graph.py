"""Greedy verification as one CUDA graph: a uniform step of ``q = 1 + k`` tokens a row and the acceptance
(:func:`~llmplug.spec.rejection.greedy_accept`) replayed together; the step's host inputs reach the device in one copy
and its result comes back in one read.

Between two verify steps the GPU waits for the host (the drafts need the accepted tokens), so every launch and copy
the host makes there lengthens the step. NOTE: H100, Llama-3-8B shape, oracle at alpha 0.8, batch 1: 2.54x -> 2.69x
with this graph and the measured-cost policy together (BENCHMARKS.md, "Speculative decoding: verify graph, ...").
"""

from __future__ import annotations

import torch

from ..engine.runner import MAX_GRAPH_QUERY
from .rejection import greedy_accept


def greedy_verify(runner, ids: list[list[int]], firsts: list[int], counts: list[int],
                  tables: torch.Tensor) -> torch.Tensor | None:
    """Launch the greedy verification of every row's drafts in the graph of (rows bucket, ``q``) -> ``(rows, q + 1)``
    on the device, each row its emitted tokens padded with -1 to ``q`` and, last, how many it emitted (a view of the
    graph's buffer: read it before the next call); None where steps run eagerly (no graphs, ``q`` too long). While
    the runner captures layer inputs, ``runner.aux_hidden`` holds the step's (``(rows * q, A)``), as after any step.

    Args:
        runner: the model's :class:`~llmplug.engine.runner.ModelRunner`.
        ids: per row ``q`` token ids: its last emitted token, then its drafts (padded with any id past ``counts``).
        firsts: per row the position of its first token (its KV is computed below it).
        counts: per row how many of its ``q - 1`` drafts are real.
        tables: ``(rows, M)`` the rows' device page tables (pages for ``firsts + q`` tokens).
    """
    rows, q = len(ids), len(ids[0])
    bucket = runner.graph_bucket(rows)
    if bucket is None or q > MAX_GRAPH_QUERY:
        return None
    graph, buf = runner._graphs.get(runner._key("verify", bucket, q)) or _capture(runner, bucket, q)
    pad = bucket - rows
    flat = [t for row in ids for t in row] + [0] * (pad * q) + firsts + [-1] * pad + counts + [0] * pad
    host = buf["host"]
    host.copy_(torch.tensor(flat, dtype=torch.long))
    # the caller read the previous call's result, which the device wrote after this buffer's last copy: it is free
    buf["staged"].copy_(host, non_blocking=True)
    buf["block_tables"][:rows, :tables.shape[1]].copy_(tables)
    graph.replay()
    if runner.aux_layers:
        runner.aux_hidden = buf["aux"][:rows * q]
    return buf["result"][:rows]


def _capture(runner, bucket: int, q: int):
    dev = runner.device
    staged = torch.zeros(bucket * q + 2 * bucket, dtype=torch.long, device=dev)
    buf = {"staged": staged, "input_ids": staged[:bucket * q], "positions": staged[bucket * q:bucket * (q + 1)],
           "counts": staged[bucket * (q + 1):],
           "block_tables": torch.zeros(bucket, runner.max_blocks_per_seq, dtype=torch.int32, device=dev),
           "result": torch.zeros(bucket, q + 1, dtype=torch.long, device=dev)}
    buf["positions"].fill_(-1)

    def step():
        logits = runner._uniform_forward(buf, q)
        drafted = buf["input_ids"].view(bucket, q)[:, 1:]
        tokens, emitted = greedy_accept(logits.view(bucket, q, -1), drafted, buf["counts"])
        buf["result"][:, :q].copy_(tokens)
        buf["result"][:, q].copy_(emitted)
        return logits

    graph, buf = runner._capture(runner._key("verify", bucket, q), buf, step)
    buf["host"] = torch.empty(staged.numel(), dtype=torch.long, pin_memory=True)
    return graph, buf
