"""Packed steps (prefill chunks, prefill mixed with decodes) replayed as one CUDA graph per token bucket, attention
included.

A packed step's metadata (its sequences, where each starts, how much context each has) changes every step, but the
attention kernels' grids need only the token and sequence counts: the prefill kernel finds each query tile's sequence
itself and skips zero-length sequences, the decode kernel zeroes rows of length 0. So for a bucket of ``N`` tokens
the layers (``body`` of :class:`~llmplug.patches.decoder.FusedDecoder` for the fused families, of
:class:`~llmplug.engine.hf_layers.HFLayers` for any other) are captured once, on metadata buffers of fixed size: ``N``
token slots, ``S = min(N, max_seqs)`` decode rows, then ``S`` prefill sequences. A step of ``T <= N`` tokens, ``nd <=
S`` decode rows and ``np <= S`` prefill sequences copies its metadata in (padding: slot -1, decode length 0,
zero-length sequences) and replays; the ``N - T`` pad tokens are computed and never stored nor attended. The ``head``
(the lm_head on the rows that want logits, whose count changes every step) runs eagerly.

The decode rows' padding (``nd`` to ``S``) overlaps the prefill tokens' rows; the decode kernel zeroes them first
and the prefill kernel then writes them (:func:`~llmplug.engine.attention.paged_attention`). A model whose capture
fails keeps eager steps, with a warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..ops._triton import programmatic_launch
from .metadata import AttentionMetadata


@dataclass
class _Graph:
    """One bucket's graph, the buffers it reads (``input_ids, positions (N,)``, ``meta``: the step's attention
    metadata, ``S`` decode rows then ``S`` prefill sequences) and the body's output it leaves (``hidden, residual
    (N, E)``; ``residual`` None for :class:`HFLayers`)."""

    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    hidden: torch.Tensor
    residual: torch.Tensor | None

    @property
    def seqs(self) -> int:
        return self.meta.num_decodes


class PackedGraphs:
    """The packed-step graphs of one runner's layers (``decoder``: ``body``, ``head``), per token bucket (captured by
    :meth:`capture`, never mid-run)."""

    def __init__(self, runner, decoder, buckets: tuple[int, ...]) -> None:
        self.runner, self.decoder, self.buckets = runner, decoder, buckets
        self._graphs: dict[int, _Graph] = {}
        self.unsupported: str | None = None  # why this model keeps eager steps, once found

    def bucket(self, meta: AttentionMetadata, tokens: int) -> int | None:
        """The captured bucket the packed step ``meta`` of ``tokens`` tokens replays, or None (eager)."""
        if meta.query_len or meta.token_seq_lens is not None:
            return None
        nd, rows = meta.num_decodes, meta.block_tables.shape[0]
        return next((n for n, g in sorted(self._graphs.items()) if n >= tokens and max(nd, rows - nd) <= g.seqs), None)

    def clear(self) -> None:
        self._graphs.clear()

    def capture(self, max_tokens: int, max_seqs: int) -> list[int]:
        """Capture every bucket up to the first one of at least ``max_tokens`` tokens (the Engine's step budget), each
        for up to ``max_seqs`` sequences; returns the captured buckets."""
        check = getattr(self.decoder, "matches_forward", None)
        if self.unsupported is None and check is not None and not check(self.runner):
            self.unsupported = "its logits after the lm_head differ from its forward's"
        if self.unsupported is not None:
            return []
        wanted = [n for n in self.buckets if n < max_tokens]
        wanted += [n for n in self.buckets if n >= max_tokens][:1]
        try:
            for n in wanted:
                if n not in self._graphs or self._graphs[n].seqs < min(n, max_seqs):
                    self._graphs[n] = self._capture(n, min(n, max_seqs))
        except Exception as error:  # noqa: BLE001 - an optimisation this model cannot take: it keeps eager steps
            self.clear()
            self.unsupported = f"capturing its layers failed: {type(error).__name__}: {error}"
            warnings.warn(f"llmplug runs this model's packed steps eagerly ({self.unsupported})", stacklevel=2)
        return sorted(self._graphs)

    def _capture(self, n: int, seqs: int) -> _Graph:
        runner, dev = self.runner, self.runner.device
        input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        positions = torch.zeros(n, dtype=torch.long, device=dev)
        meta = padded_metadata(n, seqs, runner.max_blocks_per_seq, dev)
        runner.ensure_cache()
        runner.meta = meta
        try:
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream), programmatic_launch():
                for _ in range(2):  # warm up: Triton and Dynamo compile, cuBLAS picks kernels
                    self.decoder.body(runner, input_ids, positions)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=runner._graph_pool()), programmatic_launch():
                hidden, residual = self.decoder.body(runner, input_ids, positions)
        finally:
            runner.meta = None
        return _Graph(graph, input_ids, positions, meta, hidden, residual)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_indices: torch.Tensor | None, n: int) -> torch.Tensor:
        """The packed step ``meta`` of ``input_ids, positions (T,)`` in bucket ``n`` (:meth:`bucket`) -> logits
        ``(R, V)`` of the rows ``logits_indices`` (all ``T`` if None)."""
        g, t = self._graphs[n], input_ids.shape[0]
        g.input_ids[:t].copy_(input_ids)
        g.positions[:t].copy_(positions)  # the pads keep earlier, valid, positions
        fill_metadata(g.meta, meta, t)
        g.graph.replay()
        with programmatic_launch():
            residual = None if g.residual is None else g.residual[:t]
            return self.decoder.head(g.hidden[:t], residual, logits_indices)


def padded_metadata(tokens: int, seqs: int, width: int, device: torch.device) -> AttentionMetadata:
    """Metadata buffers of a captured packed step: ``tokens`` token slots, ``seqs`` decode rows, then ``seqs`` prefill
    sequences of up to ``width`` pages; all padding (nothing stored, nothing attended) until :func:`fill_metadata`."""
    rows = 2 * seqs
    return AttentionMetadata(
        query_len=0, slot_mapping=torch.full((tokens,), -1, dtype=torch.long, device=device),
        block_tables=torch.zeros(rows, width, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.zeros(rows + 1, dtype=torch.int32, device=device),
        context_lens=torch.zeros(rows, dtype=torch.int32, device=device), max_seqlen_q=tokens, num_decodes=seqs,
        seq_lens=torch.zeros(seqs, dtype=torch.int32, device=device))


def fill_metadata(dst: AttentionMetadata, src: AttentionMetadata, tokens: int) -> None:
    """Copy the packed step ``src`` of ``tokens`` tokens into :func:`padded_metadata`'s ``dst``, the rest padding: the
    decode rows after ``src``'s with length 0, the prefill sequences after ``src``'s with no tokens."""
    s, nd = dst.num_decodes, src.num_decodes
    num_prefill, width = src.block_tables.shape[0] - nd, src.block_tables.shape[1]
    dst.slot_mapping[:tokens].copy_(src.slot_mapping)
    dst.slot_mapping[tokens:].fill_(-1)
    dst.seq_lens[:nd].copy_(src.seq_lens)
    dst.seq_lens[nd:].zero_()
    dst.block_tables[:nd, :width].copy_(src.block_tables[:nd])
    dst.block_tables[s:s + num_prefill, :width].copy_(src.block_tables[nd:])
    dst.cu_seqlens_q[s:s + num_prefill + 1].copy_(src.cu_seqlens_q[nd:])
    dst.cu_seqlens_q[s + num_prefill + 1:].fill_(tokens)
    dst.context_lens[s:s + num_prefill].copy_(src.context_lens[nd:])
