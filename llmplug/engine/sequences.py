"""``generate``'s static batch on the shared runtime: its rows as Engine sequences, chunked prefill, decode steps."""

from __future__ import annotations

import torch

from .late_stops import LateStops
from .params import SamplingParams
from .request import Request
from .runner import GREEDY_RING, ModelRunner
from .step import build_step, to_device

_ROW_PARAMS = SamplingParams()  # generate's rows sample through HF's processors, never through these


class SequenceBatch:
    """The rows of one ``generate`` (or scoring) call as the Engine's :class:`Sequence` objects in the model's shared
    page pool: prompts unpadded, prefilled in chunks, pages grown as rows advance, every step built by
    :func:`~llmplug.engine.step.build_step` and run by :meth:`ModelRunner.step`.

    Generated tokens stay on the device (HF's ``input_ids``); a row's ``tokens`` hold its prompt, ``num_computed``
    counts every token with KV. Prompt blocks already in the prefix cache are reused (``prefix_cache``) and full
    prompt blocks are cached for later calls and Engine requests. While the runner captures layer inputs
    (:meth:`ModelRunner.capture_aux`), prefill keeps them: :meth:`prefill_aux`.

    Args:
        runner: the model's runner (owns the KV pool).
        input_ids: ``(B, L)`` prompts, left- or right-padded.
        attention_mask: ``(B, L)`` 1 for real tokens, or None when nothing is padded.
        max_length: longest total length a row may reach (prompt + new tokens).
        prefix_cache: reuse cached prompt blocks and cache this call's (False where every prompt position must be
            computed, as in scoring).
    """

    def __init__(self, runner: ModelRunner, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 max_length: int, prefix_cache: bool = True) -> None:
        self.runner = runner
        self.device = input_ids.device
        cache = runner.ensure_cache()
        self.pool = cache.blocks
        self.block_size = cache.block_size
        ids = input_ids.tolist()
        if attention_mask is None:
            prompts = ids
        else:
            prompts = [[t for t, m in zip(row, keep) if m] for row, keep in zip(ids, attention_mask.bool().tolist())]
        lengths = [len(p) for p in prompts]
        if min(lengths) == 0:
            raise ValueError(f"row {lengths.index(0)} of input_ids has no unmasked token: an empty prompt")
        longest = max(max(lengths), max_length)
        if longest > runner.max_model_len:
            raise ValueError(f"sequences of up to {longest} tokens exceed max_model_len={runner.max_model_len}; "
                             "pass optimize(model, max_model_len=...) or shorten max_length/max_new_tokens")
        self.prefix_cache = prefix_cache
        self.seqs = [Request(f"row{i}", p, _ROW_PARAMS).seqs[0] for i, p in enumerate(prompts)]
        self._aux: list[list[torch.Tensor]] = [[] for _ in prompts]  # prefill's captured layer inputs, per row
        width = -(-longest // self.block_size)
        self.block_table = torch.zeros(len(prompts), width, dtype=torch.int32)
        if prefix_cache:
            runner.forget_stale_prefixes()
        for row, seq in enumerate(self.seqs):
            if prefix_cache:
                seq.blocks, seq.entry_ids = self.pool.match(seq.tokens)
                seq.num_computed = len(seq.blocks) * self.block_size
                self.block_table[row, :len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        self.block_table_dev = self.block_table.to(self.device)

    def __len__(self) -> int:
        return len(self.seqs)

    # ---- pages ---------------------------------------------------------------------------------------------
    def _grow(self, rows, num_tokens) -> bool:
        """Give row ``rows[i]`` room for ``num_tokens[i]`` tokens; all new page ids reach the device in one copy.
        Returns whether any row got a page.

        The copy's source is a fresh pinned snapshot of the table, so it is truly asynchronous and a later host-side
        edit can never race it.
        """
        grown = False
        for row, n in zip(rows, num_tokens):
            seq = self.seqs[row]
            need = -(-n // self.block_size) - len(seq.blocks)
            if need > 0:
                old = len(seq.blocks)
                seq.blocks.extend(self.pool.allocate(need))
                self.block_table[row, old:len(seq.blocks)] = torch.tensor(seq.blocks[old:], dtype=torch.int32)
                grown = True
        if grown:
            src = self.block_table.pin_memory() if self.device.type == "cuda" else self.block_table.clone()
            self.block_table_dev.copy_(src, non_blocking=True)
        return grown

    def release(self) -> None:
        """Give every row's pages back (cached prompt blocks stay findable until evicted)."""
        for seq in self.seqs:
            if seq.blocks:
                self.pool.free(seq.blocks)
                seq.blocks = []

    # ---- steps ---------------------------------------------------------------------------------------------
    def prefill(self, every_token: bool = False) -> torch.Tensor | list[torch.Tensor]:
        """Run every prompt through the model in chunks of ``max_prefill_tokens``; logits ``(B, V)`` of last tokens, or
        with ``every_token`` each prompt's logits ``(L_i, V)`` at every token (a list, in row order)."""
        budget = self.runner.config.max_prefill_tokens
        logits = [None] * len(self.seqs)
        pieces: list[list[torch.Tensor]] = [[] for _ in self.seqs]
        row = 0
        while row < len(self.seqs):
            rows, takes, left = [], [], budget
            while row < len(self.seqs) and left > 0:
                todo = self.seqs[row].num_tokens - self.seqs[row].num_computed
                take = min(todo, left)
                rows.append(row)
                takes.append(take)
                left -= take
                if take == todo:
                    row += 1
            out = self._prefill_chunk(rows, takes, every_token)
            for i, r in enumerate(rows):
                if every_token:
                    pieces[r].append(out[i])
                elif self.seqs[r].num_computed == self.seqs[r].num_tokens:
                    logits[r] = out[i]
        if self.prefix_cache:
            for seq in self.seqs:
                seq.register_full_blocks(self.pool)
        return [torch.cat(p) for p in pieces] if every_token else torch.stack(logits)

    def _prefill_chunk(self, rows: list[int], takes: list[int], every_token: bool) -> list[torch.Tensor]:
        """One step over ``takes[i]`` more prompt tokens of row ``rows[i]`` -> per row its last logits ``(V,)``, or
        with ``every_token`` its chunk's ``(takes[i], V)``."""
        seqs = [self.seqs[r] for r in rows]
        self._grow(rows, [s.num_computed + n for s, n in zip(seqs, takes)])
        ctx = build_step(seqs, takes, self.block_size, self.device, block_tables=self.tables(rows),
                         all_logits=every_token)
        out = self.runner.step(ctx)
        for seq, n in zip(seqs, takes):
            seq.num_computed += n
        if self.runner.aux_hidden is not None:
            for r, aux in zip(rows, self.runner.aux_hidden.clone().split(takes)):
                self._aux[r].append(aux)
        return list(out.split(takes)) if every_token else list(out)

    def prefill_aux(self) -> list[torch.Tensor]:
        """Per row ``(n, A)``: the layer inputs :meth:`ModelRunner.capture_aux` captured at the prompt positions
        prefill computed (every position without ``prefix_cache``)."""
        return [torch.cat(a) for a in self._aux]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (``tokens: (B,)`` on the device) -> logits ``(B, V)``. No host sync.

        Every row advances, finished ones too (their tokens are padding), as in HF's loop; pages are added on the
        host as rows cross page boundaries.
        """
        self._grow(range(len(self.seqs)), [s.num_computed + 1 for s in self.seqs])
        ctx = build_step(self.seqs, [1] * len(self.seqs), self.block_size, self.device, input_ids=tokens,
                         block_tables=self.block_table_dev)
        out = self.runner.step(ctx)
        for seq in self.seqs:
            seq.num_computed += 1
        return out

    def decode_in_graph(self, graph_buf, tokens: torch.Tensor, eos: torch.Tensor, steps: int, stops: LateStops) -> int:
        """Up to ``steps`` decode steps, each one replay of a token-choosing graph of the runner (greedy or sampling:
        the token is picked and fed back on the device); every ``GREEDY_RING`` steps the host adds the pages the
        next ring needs and copies the ring's tokens out, nothing in between. While the device runs a ring, ``stops``
        applies HF's stop bookkeeping to the ring before (:meth:`LateStops.feed`); the loop ends once it says so.

        Args:
            graph_buf: ``(graph, buffers)`` from :meth:`ModelRunner.greedy_graph` or :meth:`ModelRunner.sample_graph`
                for this batch.
            tokens: ``(B,)`` the tokens chosen last (this call's first inputs).
            eos: ``(E,)`` end-of-sequence ids, ``E <= MAX_EOS``.
            steps: most steps to run (the max-length limit).
            stops: keeps the tokens HF's loop keeps (:meth:`LateStops.new_tokens`); it also says which rows the device
                pads (:meth:`LateStops.device_flags`) and with what.

        Returns:
            How many steps the device ran (at most one ring past the step generation ended in).
        """
        rows = len(self.seqs)
        graph, buf = graph_buf
        width = self.block_table_dev.shape[1]
        self._arm(buf, list(range(rows)), tokens, stops.device_flags(), eos, stops.pad)
        queued, ran = [], 0
        while ran < steps and not stops.done:
            n = min(GREEDY_RING, steps - ran)
            # pages for the whole ring, before its first replay
            if self._grow(range(rows), [s.num_computed + ran + n for s in self.seqs]):
                buf["block_tables"][:rows, :width].copy_(self.block_table_dev)
            for _ in range(n):
                graph.replay()
            ran += n
            ring = torch.empty((rows, n), dtype=torch.long, pin_memory=True)
            ring.copy_(buf["ring"][:rows, :n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            queued.append((ring, event))
            if len(queued) > 1:  # the host reads the ring before last, so the device always has a ring to run
                self._take_ring(*queued.pop(0), stops, buf["unfinished"][:rows])
        for ring, event in queued:
            self._take_ring(ring, event, stops, buf["unfinished"][:rows])
        for seq in self.seqs:
            seq.num_computed += ran
        return ran

    def ring(self, rows: list[int], last: list[int], n: int) -> list[list[int]] | None:
        """``n <= GREEDY_RING`` greedy decode steps of ``rows`` (their last tokens ``last``), each one replay of the
        runner's greedy graph, read once -> each row's ``n`` new tokens; None where decode steps run eagerly. No stop
        is applied on the device (the caller's bookkeeping decides what it keeps)."""
        graph_buf = self.runner.greedy_graph(len(rows))
        if graph_buf is None:
            return None
        graph, buf = graph_buf
        self._grow(rows, [self.seqs[r].num_computed + n for r in rows])
        self._arm(buf, rows, torch.tensor(last), True, torch.empty(0, dtype=torch.long), 0)
        for _ in range(n):
            graph.replay()
        for r in rows:
            self.seqs[r].num_computed += n
        return buf["ring"][:len(rows), :n].tolist()

    def tables(self, rows: list[int]) -> torch.Tensor:
        """``(len(rows), M)`` device page table of ``rows`` (the table itself when they are every row, in order)."""
        return self.block_table_dev if rows == list(range(len(self.seqs))) else self.block_table_dev[rows]

    def _arm(self, buf: dict[str, torch.Tensor], rows: list[int], tokens: torch.Tensor, unfinished: torch.Tensor | bool,
             eos: torch.Tensor, pad: int) -> None:
        """:meth:`ModelRunner.arm_token_loop` for ``rows`` (their positions and pages)."""
        positions = to_device(torch.tensor([self.seqs[r].num_computed for r in rows]), self.device)
        self.runner.arm_token_loop(buf, tokens, positions, self.tables(rows), unfinished, eos, pad)

    @staticmethod
    def _take_ring(ring: torch.Tensor, event, stops: LateStops, unfinished: torch.Tensor) -> None:
        if stops.done:
            return
        event.synchronize()
        stops.feed(ring)
        stops.push_finished(unfinished)
