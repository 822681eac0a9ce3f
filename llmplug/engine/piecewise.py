"""Packed steps (prefill chunks, prefill mixed with decodes) as CUDA graphs per token bucket, with each layer's
attention run eagerly between them.

A packed step's metadata (its sequences, where each starts, how much context each has) changes every step, and the
attention kernels' grids follow it; everything else in a layer depends on the token count alone. So for a bucket of
``N`` tokens the layers (``body`` of :class:`~llmplug.patches.decoder.FusedDecoder` for the fused families, of
:class:`~llmplug.engine.hf_layers.HFLayers` for any other) are captured as ``L + 1`` pieces: the embedding up to layer
0's q/k/v, layer 0's o projection up to layer 1's q/k/v, ..., the last MLP. A step of ``T <= N`` tokens replays them in
turn, and between two pieces runs that layer's ``attention`` on its ``T`` real tokens. The ``head`` (the lm_head on the
rows that want logits, whose count changes every step) runs eagerly too. The ``N - T`` pad tokens are computed and
never stored nor attended; their attention rows keep whatever they held.

Each piece ends by copying its layer's q, k, v into buffers every bucket shares, and the next one reads the attention
output from another, so the pieces hold no per-layer activations between steps. A model whose capture fails keeps
eager steps, with a warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..ops._triton import programmatic_launch


@dataclass
class _Pieces:
    """One bucket's captured pieces and the tensors they read and leave.

    Attributes:
        graphs: ``L + 1`` graphs, replayed in order.
        input_ids, positions: ``(N,)`` the step's tokens, then pads (which keep earlier, valid, values).
        extra: per layer, the arguments its ``attention`` takes after ``q, k, v`` (tensors of ``N`` rows, as the
            fused families' cos and sin, are sliced to the step's tokens).
        hidden, residual: ``(N, E)`` the last piece's output (``body``'s; ``residual`` None for :class:`HFLayers`).
    """

    graphs: list[torch.cuda.CUDAGraph]
    input_ids: torch.Tensor
    positions: torch.Tensor
    extra: list[tuple]
    hidden: torch.Tensor
    residual: torch.Tensor | None


class PiecewiseGraphs:
    """The piecewise graphs of one runner's layers (``decoder``: ``body``, ``attention``, ``head``), per token bucket
    (captured by :meth:`capture`, never mid-run), and the attention buffers they share: ``q (N, H, D)``,
    ``k, v (N, Hkv, D)``, ``o (N, H, D)`` for the largest bucket ``N``."""

    def __init__(self, runner, decoder, buckets: tuple[int, ...]) -> None:
        self.runner, self.decoder, self.buckets = runner, decoder, buckets
        self._pieces: dict[int, _Pieces] = {}
        self._attn: dict[str, torch.Tensor] = {}  # "q", "k", "v", "o": the largest bucket's, sliced for the others
        self.unsupported: str | None = None  # why this model keeps eager steps, once found

    def bucket(self, tokens: int) -> int | None:
        """The captured bucket a step of ``tokens`` tokens replays, or None (eager)."""
        return next((n for n in sorted(self._pieces) if n >= tokens), None)

    def clear(self) -> None:
        self._pieces.clear()
        self._attn.clear()

    def capture(self, max_tokens: int) -> list[int]:
        """Capture every bucket up to the first one of at least ``max_tokens`` (the Engine's step budget) that is not
        captured yet; returns the captured buckets. A bucket larger than the shared buffers recaptures them all."""
        check = getattr(self.decoder, "matches_forward", None)
        if self.unsupported is None and check is not None and not check(self.runner):
            self.unsupported = "its logits after the lm_head differ from its forward's"
        if self.unsupported is not None:
            return []
        wanted = [n for n in self.buckets if n < max_tokens]
        wanted += [n for n in self.buckets if n >= max_tokens][:1]
        if self._attn and max(wanted, default=0) > self._attn["q"].shape[0]:
            wanted = sorted(set(wanted) | set(self._pieces))
            self.clear()
        try:
            for n in sorted(wanted, reverse=True):  # the largest first: it sizes the shared attention buffers
                if n not in self._pieces:
                    self._pieces[n] = self._capture(n)
        except Exception as error:  # noqa: BLE001 - an optimisation this model cannot take: it keeps eager steps
            self.clear()
            self.unsupported = f"capturing its layers failed: {type(error).__name__}: {error}"
            warnings.warn(f"llmplug runs this model's packed steps eagerly ({self.unsupported})", stacklevel=2)
        return sorted(self._pieces)

    def _buffers(self, n: int, q: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self._attn:
            self._attn = {"q": q.new_zeros((n,) + q.shape[1:]), "k": k.new_zeros((n,) + k.shape[1:]),
                          "v": k.new_zeros((n,) + k.shape[1:]), "o": q.new_zeros((n,) + q.shape[1:])}
        return {name: buf[:n] for name, buf in self._attn.items()}

    def _capture(self, n: int) -> _Pieces:
        runner, dev = self.runner, self.runner.device
        input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        positions = torch.zeros(n, dtype=torch.long, device=dev)
        extra: list = [None] * runner.num_layers
        bufs: dict[str, torch.Tensor] = {}

        def stage(i, q, k, v, *rest):  # copy the layer's attention inputs out; the next piece reads "o"
            if not bufs:
                bufs.update(self._buffers(n, q, k))
            bufs["q"].copy_(q)
            bufs["k"].copy_(k)
            bufs["v"].copy_(v)
            extra[i] = rest
            return bufs["o"]

        graphs: list[torch.cuda.CUDAGraph] = []
        open_ = []  # the graph being captured, if any

        def begin():
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=runner._graph_pool())
            open_.append(graphs[-1])

        def end():
            open_.pop().capture_end()

        def cut(i, q, k, v, *rest):  # end this piece, start the next
            o = stage(i, q, k, v, *rest)
            end()
            begin()
            return o

        runner.ensure_cache()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), programmatic_launch():
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks kernels, the shared buffers are made
                self.decoder.body(runner, input_ids, positions, attend=stage)
            torch.cuda.synchronize(dev)
            begin()
            try:
                hidden, residual = self.decoder.body(runner, input_ids, positions, attend=cut)
            finally:  # an error mid-capture still ends it, so the stream is usable again
                if open_:
                    end()
        torch.cuda.current_stream(dev).wait_stream(stream)
        return _Pieces(graphs, input_ids, positions, extra, hidden, residual)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor | None,
            n: int) -> torch.Tensor:
        """The step ``runner.meta`` describes, of ``input_ids, positions (T,)``, in bucket ``n`` -> logits ``(R, V)`` of
        the rows ``logits_indices`` (all ``T`` if None)."""
        p, t = self._pieces[n], input_ids.shape[0]
        p.input_ids[:t].copy_(input_ids)
        p.positions[:t].copy_(positions)
        attn = {name: buf[:t] for name, buf in self._attn.items()}
        with programmatic_launch():
            for i, graph in enumerate(p.graphs[:-1]):
                graph.replay()
                rest = (x[:t] if isinstance(x, torch.Tensor) else x for x in p.extra[i])
                self.decoder.attention(self.runner, i, attn["q"], attn["k"], attn["v"], *rest, out=attn["o"])
            p.graphs[-1].replay()
            residual = None if p.residual is None else p.residual[:t]
            return self.decoder.head(p.hidden[:t], residual, logits_indices)
