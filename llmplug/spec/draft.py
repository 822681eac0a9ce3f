"""A draft model's side of speculative decoding, shared by ``generate`` (:class:`~llmplug.spec.proposers.
DraftModelProposer`) and the Engine (:mod:`llmplug.engine.engine_draft`).

The draft (an HF causal LM with the target's tokenizer, on llmplug with its own runner and paged KV pool) keeps one
draft-side sequence per target row: ``tokens`` (the target's tokens it was last pointed at, then the drafts it fed
itself), ``num_computed`` (its tokens with KV), ``blocks`` (its pages in the draft's pool) and ``resolved`` (leading
tokens known to be the target's; the rest are unverified drafts). Before proposing, :func:`catch_up` rolls a row back
to the longest prefix its tokens share with the target's (accepted drafts keep their KV, rejected ones are dropped);
:func:`draft_greedy` then feeds every row's missing tokens in one step and runs greedy decode steps, all rows
batched, and reads the drafts once (or leaves them on the device for a verify step to take as its inputs).
"""

from __future__ import annotations

import torch

from ..engine.runner import MAX_GRAPH_QUERY
from ..engine.step import block_table, build_step, device_tensor


def check_draft_model(draft: torch.nn.Module, target: torch.nn.Module, name: str) -> None:
    """Raise unless the HF causal LM ``draft`` (passed as ``name``) proposes only ids ``target`` embeds (it shares the
    target's tokenizer)."""
    ours = target.get_input_embeddings().num_embeddings
    theirs = draft.get_output_embeddings().out_features
    if theirs > ours:  # its drafts could be ids the model cannot embed
        raise ValueError(f"{name} proposes ids up to {theirs - 1} but the model embeds only {ours}: a draft "
                         "model must share the model's tokenizer")


def catch_up(seq, history: list[int]) -> None:
    """Point the draft-side ``seq`` at the target's ``history`` (its ``resolved`` leading tokens are ``history``'s):
    keep the KV of the longest prefix its tokens and ``history`` share, leaving at least one token to feed (its
    logits give the first draft). Compares only past ``resolved``, so a row costs its new tokens, not its length."""
    tokens = seq.tokens
    same, end = seq.resolved, min(len(tokens), len(history))
    while same < end and tokens[same] == history[same]:
        same += 1
    seq.num_computed = min(seq.num_computed, same, len(history) - 1)
    del tokens[same:]
    tokens.extend(history[same:])
    seq.resolved = len(history)


def draft_greedy(runner, seqs: list, ks: list[int], block_size: int, device: torch.device,
                 block_tables: torch.Tensor | None = None, num_new: list[int] | None = None,
                 read: bool = True) -> list[list[int]] | torch.Tensor:
    """Greedy drafts of the draft model: ``ks[i]`` ids for ``seqs[i]`` (draft-side sequences after :func:`catch_up`,
    pages held for ``num_computed + num_new[i] + ks[i] - 1`` tokens).

    One catch-up step feeds each row ``num_new[i]`` tokens (default: all its missing ones), packed with per-row
    lengths (a uniform one of up to ``MAX_GRAPH_QUERY`` tokens asks for every token's logits, so it replays the
    (rows bucket, q) graph like a verify step); then ``max(ks) - 1`` decode steps, each over the rows that still draft
    (rows are taken in decreasing ``ks`` order, so each step's rows are a prefix), the tokens staying on the device
    until all are read at once. A row with ``ks[i] == 0`` only catches up (a chunk of a long catch-up; its
    ``num_new`` may stop short). Each row's ``num_computed`` and ``tokens`` then cover what it fed: its drafts but the
    last.

    Args:
        runner: the draft model's :class:`~llmplug.engine.runner.ModelRunner`.
        block_tables: ``(len(seqs), M)`` the rows' page table on the device; None builds it from their ``blocks``.

        read: False leaves the drafts on the device (every ``ks[i]`` equal and positive): nothing waits for them,
            and the caller hands them to :func:`note_drafts` once it has read them.

    Returns:
        Each row's drafts (``[]`` where ``ks[i] == 0``); with ``read=False``, ``(len(seqs), k)`` on the device.
    """
    count = len(seqs)
    if num_new is None:
        num_new = [s.num_tokens - s.num_computed for s in seqs]
    order = sorted(range(count), key=lambda i: -ks[i])
    if order != list(range(count)):
        seqs, ks, num_new = [seqs[i] for i in order], [ks[i] for i in order], [num_new[i] for i in order]
        if block_tables is not None:
            block_tables = block_tables[device_tensor(order, block_tables.device)]
    if block_tables is None:
        block_tables = block_table([s.blocks for s in seqs], device)
    q = num_new[0] if all(n == num_new[0] for n in num_new) else 0
    every = 0 < q <= MAX_GRAPH_QUERY
    ctx = build_step(seqs, num_new, block_size, device, block_tables=block_tables, all_logits=every)
    logits = runner.step(ctx)
    drafting = sum(k > 0 for k in ks)
    steps = [(logits.view(count, q, -1)[:, -1] if every else logits)[:drafting].argmax(-1)] if drafting else []
    for seq, n in zip(seqs, num_new):
        seq.num_computed += n
    for j in range(1, max(ks, default=0)):
        rows = sum(k > j for k in ks)
        sub = seqs[:rows]
        ctx = build_step(sub, [1] * rows, block_size, device, input_ids=steps[-1][:rows],
                         block_tables=block_tables[:rows])
        steps.append(runner.step(ctx).argmax(-1))
        for seq in sub:
            seq.num_computed += 1
    if not read:
        if min(ks, default=0) != max(ks, default=1) or not ks[0]:
            raise ValueError(f"drafts stay on the device only for one positive count a row, got {ks}")
        return torch.stack(steps, dim=1)
    flat = torch.cat(steps).tolist() if steps else []  # the one read of the device
    offsets = [0]
    for part in steps:
        offsets.append(offsets[-1] + part.shape[0])
    drafts = [[flat[offsets[j] + i] for j in range(k)] for i, k in enumerate(ks)]
    note_drafts(seqs, drafts)
    out: list[list[int]] = [[] for _ in range(count)]
    for i, d in zip(order, drafts):
        out[i] = d
    return out


def note_drafts(seqs: list, drafts: list[list[int]]) -> None:
    """Record in each draft-side sequence the drafts :func:`draft_greedy` fed it (all of a row's drafts but the
    last): the next :func:`catch_up` keeps the KV of those the target accepts."""
    for seq, d in zip(seqs, drafts):
        seq.tokens.extend(d[:-1])
