"""Any decoder-only HF causal LM split as the packed-step graphs need it (:mod:`llmplug.engine.packed_graphs`):
``body`` its decoder stack, ``head`` its lm_head on the rows that want logits.

Some causal LMs do more after the lm_head than the lm_head (Granite divides the logits by a scale, Gemma 2 soft-caps
them); :meth:`HFLayers.matches_forward` runs one step both ways and keeps the split only where its logits equal the
model's own forward bit for bit.

In the graphs the stack runs through ``torch.compile(backend="llmplug")``: Inductor with llmplug's passes compiles the
code between two attention calls (the attention breaks the graph), once per token bucket at warm-up (automatic dynamic
shapes after the first), and the graphs capture what it compiled. A stack Dynamo cannot compile runs as it is.
"""

from __future__ import annotations

import warnings

import torch

from .metadata import AttentionMetadata


class HFLayers:
    """The decoder stack (``model.get_decoder()``) and the lm_head of ``model``, a causal LM llmplug's runner drives
    through HF's own forward (:func:`~llmplug.engine.runner.hf_forward`)."""

    def __init__(self, model: torch.nn.Module, compile: bool = True) -> None:
        from ..inductor import llmplug_backend  # the callable: no reliance on the installed entry point

        self.model, self.base = model, model.get_decoder()
        self.stack = torch.compile(self.base, backend=llmplug_backend) if compile else self.base  # what body runs

    def body(self, runner, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``input_ids, positions (T,)`` -> ``(hidden (T, E), None)``: the (compiled) stack's output, final norm
        included, each layer's attention on the step ``runner.meta`` describes."""
        with runner.llmplug_attention():
            return self._run(self.stack, input_ids, positions), None

    def _run(self, stack, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        try:
            return stack(input_ids=input_ids[None], position_ids=positions[None], use_cache=False).last_hidden_state[0]
        except Exception as error:  # noqa: BLE001 - Dynamo or Inductor cannot take this stack: run it as it is
            if stack is self.base or (input_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
                raise
            warnings.warn(f"llmplug's packed-step graphs run this model's layers uncompiled: torch.compile failed "
                          f"({type(error).__name__}: {error})", stacklevel=3)
            self.stack = self.base
            return self._run(self.base, input_ids, positions)

    def head(self, hidden: torch.Tensor, residual: None, logits_indices: torch.Tensor | None) -> torch.Tensor:
        """The lm_head on rows ``logits_indices`` (all if None) of :meth:`body`'s ``hidden`` -> logits ``(R, V)``."""
        return self.model.get_output_embeddings()(hidden if logits_indices is None else hidden[logits_indices])

    @torch.inference_mode()
    def matches_forward(self, runner) -> bool:
        """Whether :meth:`head` on the (uncompiled) stack's output gives the model's own forward's logits, bit for
        bit, on a 5-token prompt (a step that stores nothing)."""
        dev, n = runner.device, 5
        meta = AttentionMetadata(query_len=0, slot_mapping=torch.full((n,), -1, dtype=torch.long, device=dev),
                                 block_tables=torch.zeros(1, 1, dtype=torch.int32, device=dev),
                                 cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
                                 context_lens=torch.zeros(1, dtype=torch.int32, device=dev), max_seqlen_q=n)
        ids = torch.arange(3, 3 + n, device=dev) % runner.model.config.get_text_config().vocab_size
        positions, rows = torch.arange(n, device=dev), torch.tensor([2, n - 1], device=dev)
        want = runner._forward(ids, positions, meta, rows)
        runner.ensure_cache()
        runner.meta = meta
        try:
            with runner.llmplug_attention():
                got = self.head(self._run(self.base, ids, positions), None, rows)
        finally:
            runner.meta = None
        return got.shape == want.shape and torch.equal(got, want)
