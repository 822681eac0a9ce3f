"""Packed steps (prefill chunks, prefill mixed with decodes) replayed as one CUDA graph per token bucket, attention
included.

A packed step's metadata (its sequences, where each starts, how much context each has) changes every step, but the
attention kernels' grids need only the token and sequence counts: the prefill kernel finds each query tile's sequence
itself and skips zero-length sequences, the decode kernel zeroes rows of length 0. So for a bucket of ``N`` tokens
the layers (``body`` of :class:`~llmplug.patches.decoder.FusedDecoder` for the fused families, of
:class:`~llmplug.engine.hf_layers.HFLayers` for any other) are captured on metadata buffers of fixed size: ``N`` token
slots, ``D`` decode rows, then ``S = min(N, max_seqs)`` prefill sequences (two graphs a bucket: ``D = S`` and a
smaller ``D``, :class:`PackedGraphs`). A step of ``T <= N`` tokens, ``nd <= D`` decode rows and ``np <= S`` prefill
sequences copies its metadata in (padding: slot -1, decode length 0, zero-length sequences) and replays; the ``N - T``
pad tokens are computed and never stored nor attended. The ``head`` (the lm_head on the rows that want logits, whose
count changes every step) runs eagerly.

The decode rows' padding (``nd`` to ``D``) overlaps the prefill tokens' rows; the decode kernel zeroes them first
and the prefill kernel then writes them (:func:`~llmplug.engine.attention.paged_attention`). A model whose capture
fails keeps eager steps, with a warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..ops._triton import programmatic_launch
from .metadata import AttentionMetadata

FEW_DECODES = 32  # decode rows of a bucket's second graph: its decode kernel splits long contexts as eager steps do


@dataclass
class _Graph:
    """One graph, the buffers it reads (``input_ids, positions (N,)``, ``meta``: the step's attention metadata, decode
    rows then prefill sequences) and the body's output it leaves (``hidden, residual (N, E)``; ``residual`` None for
    :class:`HFLayers`)."""

    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    hidden: torch.Tensor
    residual: torch.Tensor | None

    def fits(self, meta: AttentionMetadata, tokens: int) -> bool:
        """Whether the packed step ``meta`` of ``tokens`` tokens fits this graph's buffers."""
        decodes, rows = self.meta.num_decodes, self.meta.block_tables.shape[0]
        return (tokens <= self.input_ids.shape[0] and meta.num_decodes <= decodes
                and meta.block_tables.shape[0] - meta.num_decodes <= rows - decodes)


class PackedGraphs:
    """The packed-step graphs of one runner's layers (``decoder``: ``body``, ``head``), captured by :meth:`capture`
    (never mid-run). Per token bucket ``N``, for up to ``S = min(N, max_seqs)`` sequences, two graphs: one with ``S``
    decode rows, one with ``min(S, FEW_DECODES)``. The decode kernel's split count follows its row count (static in a
    graph): with few decode rows each long context is split over more programs, as an eager step would."""

    def __init__(self, runner, decoder, buckets: tuple[int, ...]) -> None:
        self.runner, self.decoder, self.buckets = runner, decoder, buckets
        self._graphs: dict[tuple[int, int], _Graph] = {}  # (tokens, decode rows) -> graph, in that order
        self.unsupported: str | None = None  # why this model keeps eager steps, once found

    def bucket(self, meta: AttentionMetadata, tokens: int) -> tuple[int, int] | None:
        """The captured graph the packed step ``meta`` of ``tokens`` tokens replays (its key), or None (eager)."""
        if meta.query_len or meta.token_seq_lens is not None:
            return None
        return next((key for key, g in self._graphs.items() if g.fits(meta, tokens)), None)

    @property
    def token_buckets(self) -> list[int]:
        """The token buckets captured."""
        return sorted({n for n, _ in self._graphs})

    def clear(self) -> None:
        self._graphs.clear()

    def capture(self, max_tokens: int, max_seqs: int) -> list[int]:
        """Capture the graphs of every bucket up to the first one of at least ``max_tokens`` tokens (the Engine's step
        budget), each for up to ``max_seqs`` sequences; returns the captured token buckets."""
        check = getattr(self.decoder, "matches_forward", None)
        if self.unsupported is None and check is not None and not check(self.runner):
            self.unsupported = "its logits after the lm_head differ from its forward's"
        if self.unsupported is not None:
            return []
        wanted = [n for n in self.buckets if n < max_tokens]
        wanted += [n for n in self.buckets if n >= max_tokens][:1]
        keys = {(n, d, min(n, max_seqs)) for n in wanted for d in (min(n, max_seqs, FEW_DECODES), min(n, max_seqs))}
        try:
            for n, decodes, seqs in sorted(keys):
                g = self._graphs.get((n, decodes))
                if g is None or g.meta.block_tables.shape[0] - decodes < seqs:
                    self._graphs[(n, decodes)] = self._capture(n, decodes, seqs)
        except Exception as error:  # noqa: BLE001 - an optimisation this model cannot take: it keeps eager steps
            self.clear()
            self.unsupported = f"capturing its layers failed: {type(error).__name__}: {error}"
            warnings.warn(f"llmplug runs this model's packed steps eagerly ({self.unsupported})", stacklevel=2)
        self._graphs = dict(sorted(self._graphs.items()))  # bucket() takes the first that fits: the smallest
        if self._graphs:
            self._warm_head(max_seqs)
        return self.token_buckets

    @torch.inference_mode()
    def _warm_head(self, max_rows: int) -> None:
        """Run the eager head once on every row count a packed step can ask logits for (1 .. ``max_rows``).

        Mid-run, a packed step's first head at a new row count stalled the host until the GPU had finished the work
        queued before it (cuBLAS picks its kernel by the row count; CUDA's lazy loading of that kernel is the likely
        cause), so the step-ahead pipeline emptied. NOTE: H100, 1B workload (a), 20 of 35 packed steps stalled 13-28 ms
        (BENCHMARKS.md, "Fifth session of 2026-11-27")."""
        g = self._graphs[max(self._graphs, key=lambda key: key[0])]  # the widest buffers
        with programmatic_launch():
            for rows in range(1, min(max_rows, g.hidden.shape[0]) + 1):
                self.decoder.head(g.hidden[:rows], None if g.residual is None else g.residual[:rows], None)
        torch.cuda.synchronize(self.runner.device)

    def _capture(self, n: int, decodes: int, seqs: int) -> _Graph:
        runner, dev = self.runner, self.runner.device
        input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        positions = torch.zeros(n, dtype=torch.long, device=dev)
        meta = padded_metadata(n, decodes, seqs, runner.max_blocks_per_seq, dev)

        def body():
            with programmatic_launch():
                return self.decoder.body(runner, input_ids, positions)

        runner.meta = meta
        try:
            graph, (hidden, residual) = runner.capture_graph(body, n)
        finally:
            runner.meta = None
        return _Graph(graph, input_ids, positions, meta, hidden, residual)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_indices: torch.Tensor | None, key: tuple[int, int]) -> torch.Tensor:
        """The packed step ``meta`` of ``input_ids, positions (T,)`` in the graph ``key`` (:meth:`bucket`) -> logits
        ``(R, V)`` of the rows ``logits_indices`` (all ``T`` if None)."""
        g, t = self._graphs[key], input_ids.shape[0]
        g.input_ids[:t].copy_(input_ids)
        g.positions[:t].copy_(positions)  # the pads keep earlier, valid, positions
        fill_metadata(g.meta, meta, t)
        g.graph.replay()
        with programmatic_launch():
            residual = None if g.residual is None else g.residual[:t]
            return self.decoder.head(g.hidden[:t], residual, logits_indices)


def padded_metadata(tokens: int, decodes: int, seqs: int, width: int, device: torch.device) -> AttentionMetadata:
    """Metadata buffers of a captured packed step: ``tokens`` token slots, ``decodes`` decode rows, then ``seqs``
    prefill sequences of up to ``width`` pages; all padding (nothing stored, nothing attended) until
    :func:`fill_metadata`."""
    rows = decodes + seqs
    return AttentionMetadata(
        query_len=0, slot_mapping=torch.full((tokens,), -1, dtype=torch.long, device=device),
        block_tables=torch.zeros(rows, width, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.zeros(rows + 1, dtype=torch.int32, device=device),
        context_lens=torch.zeros(rows, dtype=torch.int32, device=device), max_seqlen_q=tokens, num_decodes=decodes,
        seq_lens=torch.zeros(decodes, dtype=torch.int32, device=device))


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
