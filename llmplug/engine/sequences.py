"""A static batch of sequences on the paged KV pool: unpadding, chunked prefill, growing pages, decode steps."""

from __future__ import annotations

import torch

from ..kv.allocator import SequenceBlocks
from .late_stops import LateStops
from .metadata import AttentionMetadata
from .runner import GREEDY_RING, ModelRunner


class SequenceBatch:
    """The rows of one ``generate`` call.

    Args:
        runner: the model's runner (owns the KV pool).
        input_ids: ``(B, L)`` prompts, left- or right-padded.
        attention_mask: ``(B, L)`` 1 for real tokens, or None when nothing is padded.
        max_length: longest total length a row may reach (prompt + new tokens).
    """

    def __init__(self, runner: ModelRunner, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 max_length: int) -> None:
        self.runner = runner
        self.device = input_ids.device
        cache = runner.ensure_cache()
        self.block_size = cache.block_size
        if attention_mask is None:
            self.prompts = list(input_ids)
        else:
            mask = attention_mask.bool()
            self.prompts = [row[m] for row, m in zip(input_ids, mask)]
        lengths = [int(p.numel()) for p in self.prompts]
        if min(lengths) == 0:
            raise ValueError(f"row {lengths.index(0)} of input_ids has no unmasked token: an empty prompt")
        longest = max(max(lengths), max_length)
        if longest > runner.max_model_len:
            raise ValueError(f"sequences of up to {longest} tokens exceed max_model_len={runner.max_model_len}; "
                             "pass optimize(model, max_model_len=...) or shorten max_length/max_new_tokens")
        self.lengths = lengths  # tokens each row has in the KV cache once its latest token is stored
        self.blocks = [SequenceBlocks(cache.blocks, self.block_size) for _ in self.prompts]
        width = -(-longest // self.block_size)
        self.block_table = torch.zeros(len(self.prompts), width, dtype=torch.int32)
        self.block_table_dev = self.block_table.to(self.device)

    # ---- pages ---------------------------------------------------------------------------------------------
    def _grow(self, rows, num_tokens) -> bool:
        """Give row ``rows[i]`` room for ``num_tokens[i]`` tokens; all new page ids reach the device in one copy.
        Returns whether any row got a page.

        The copy's source is a fresh pinned snapshot of the table, so it is truly asynchronous and a later host-side
        edit can never race it.
        """
        grown = False
        for row, n in zip(rows, num_tokens):
            seq = self.blocks[row]
            old = len(seq.blocks)
            if seq.ensure(n):
                self.block_table[row, old:len(seq.blocks)] = torch.tensor(seq.blocks[old:], dtype=torch.int32)
                grown = True
        if grown:
            src = self.block_table.pin_memory() if self.device.type == "cuda" else self.block_table.clone()
            self.block_table_dev.copy_(src, non_blocking=True)
        return grown

    def _slot(self, row: int, pos: int) -> int:
        return self.blocks[row].blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def release(self) -> None:
        for seq in self.blocks:
            if seq.blocks:
                seq.release()

    # ---- steps ---------------------------------------------------------------------------------------------
    def prefill(self, every_token: bool = False) -> torch.Tensor | list[torch.Tensor]:
        """Run every prompt through the model in chunks of ``max_prefill_tokens``; logits ``(B, V)`` of last tokens, or
        with ``every_token`` each prompt's logits ``(L_i, V)`` at every token (a list, in row order)."""
        budget = self.runner.config.max_prefill_tokens
        logits = [None] * len(self.prompts)
        pieces: list[list[torch.Tensor]] = [[] for _ in self.prompts]
        done = [0] * len(self.prompts)
        row = 0
        while row < len(self.prompts):
            rows, starts, takes, left = [], [], [], budget
            while row < len(self.prompts) and left > 0:
                take = min(self.lengths[row] - done[row], left)
                rows.append(row)
                starts.append(done[row])
                takes.append(take)
                left -= take
                done[row] += take
                if done[row] == self.lengths[row]:
                    row += 1
            out = self._prefill_chunk(rows, starts, takes, every_token)
            if every_token:
                for r, part in zip(rows, out.split(takes)):
                    pieces[r].append(part)
                continue
            for i, r in enumerate(rows):
                if starts[i] + takes[i] == self.lengths[r]:
                    logits[r] = out[i]
        self.positions = torch.tensor(self.lengths, dtype=torch.long).to(self.device)
        return [torch.cat(p) for p in pieces] if every_token else torch.stack(logits)

    def _prefill_chunk(self, rows: list[int], starts: list[int], takes: list[int],
                       every_token: bool = False) -> torch.Tensor:
        ids, positions, slots, cu = [], [], [], [0]
        self._grow(rows, [s + n for s, n in zip(starts, takes)])
        for r, s, n in zip(rows, starts, takes):
            ids.append(self.prompts[r][s:s + n])
            positions.extend(range(s, s + n))
            slots.extend(self._slot(r, p) for p in range(s, s + n))
            cu.append(cu[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            is_decode=False,
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
            block_tables=self.block_table_dev[rows],
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(dev, non_blocking=True),
            context_lens=torch.tensor(starts, dtype=torch.int32).to(dev, non_blocking=True),
            max_seqlen_q=max(takes),
        )
        positions = torch.tensor(positions, dtype=torch.long).to(dev)
        if every_token:  # eager: the prefill graphs keep one row of logits
            return self.runner.forward(torch.cat(ids), positions, meta, None)
        last = torch.tensor(cu[1:], dtype=torch.long).to(dev, non_blocking=True) - 1
        return self.runner.prefill(torch.cat(ids), positions, meta, last)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (``tokens: (B,)`` on the device) -> logits ``(B, V)``. No host sync.

        Every row advances, finished ones too (their tokens are padding), as in HF's loop; pages are added on the
        host as rows cross page boundaries, positions advance on the device.
        """
        self.lengths = [n + 1 for n in self.lengths]
        self._grow(range(len(self.prompts)), self.lengths)
        out = self.runner.decode(tokens, self.positions, self.block_table_dev)
        self.positions += 1
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
        rows = len(self.prompts)
        graph, buf = graph_buf
        width = self.block_table_dev.shape[1]
        buf["input_ids"][:rows].copy_(tokens)
        buf["positions"].fill_(-1)
        buf["positions"][:rows].copy_(self.positions)
        buf["unfinished"].zero_()
        buf["unfinished"][:rows].copy_(stops.device_flags())
        buf["eos"].fill_(-1)
        buf["eos"][:eos.numel()].copy_(eos)
        buf["pad"].fill_(stops.pad)
        buf["counters"].zero_()
        buf["block_tables"][:rows, :width].copy_(self.block_table_dev)
        queued, ran = [], 0
        while ran < steps and not stops.done:
            n = min(GREEDY_RING, steps - ran)
            self.lengths = [length + n for length in self.lengths]
            if self._grow(range(rows), self.lengths):  # pages for the whole ring, before its first replay
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
        self.positions += ran
        return ran

    @staticmethod
    def _take_ring(ring: torch.Tensor, event, stops: LateStops, unfinished: torch.Tensor) -> None:
        if stops.done:
            return
        event.synchronize()
        stops.feed(ring)
        stops.push_finished(unfinished)
