"""``llmplug.logits(model, input_ids)``: the logits of every prompt position, computed on llmplug's paged runner.

What evaluation code gets from ``model(input_ids, attention_mask=mask).logits`` (log-likelihoods, perplexity), with
prompts unpadded and packed into steps of ``max_prefill_tokens`` tokens, so long or many prompts cost what they
hold, not what their padding holds.
"""

from __future__ import annotations

import torch

from ..state import require_state
from .sequences import SequenceBatch


@torch.inference_mode()
def logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits at every position of each row: at its real tokens what the model's own forward gives for that row
    alone (positions count from the row's first real token, as in ``generate``; a plain forward of a left-padded batch
    counts them from the padding, which only models with relative positions ignore).

    Args:
        model: a model optimized by llmplug.
        input_ids: ``(B, L)`` token ids, left- or right-padded (or ``(L,)`` for one row).
        attention_mask: ``(B, L)`` 1 for real tokens; None when nothing is padded.

    Returns:
        ``(B, L, V)`` in the model's dtype (``(L, V)`` for a 1-D ``input_ids``); zeros at masked positions.

    Raises:
        RuntimeError: the model is not optimized. ValueError: a row with no unmasked token, or rows longer than
        ``max_model_len``.
    """
    one = input_ids.dim() == 1
    if one:
        input_ids = input_ids[None]
        attention_mask = None if attention_mask is None else attention_mask[None]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, L) or (L,), got shape {tuple(input_ids.shape)}")
    state = require_state(model)
    with state.step_lock:
        seqs = SequenceBatch(state.runner, input_ids, attention_mask, input_ids.shape[1], prefix_cache=False)
        try:
            rows = seqs.prefill(every_token=True)
        finally:
            seqs.release()
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    out = rows[0].new_zeros(*input_ids.shape, rows[0].shape[-1])
    out[real] = torch.cat(rows)
    return out[0] if one else out
