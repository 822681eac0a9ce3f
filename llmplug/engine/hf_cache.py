"""The KV of a ``generate`` call handed back as the HF ``Cache`` stock ``generate`` returns.

With ``return_dict_in_generate=True`` (and ``use_cache``) stock HF returns its cache, and users continue a
conversation from it (``generate(longer_ids, past_key_values=out.past_key_values)``). HF prepares that (empty) cache
before it calls llmplug's loop; :func:`fill_hf_cache` writes llmplug's pages into it in stock's padded layout.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..ops.kv_quant import read_pages_ref

# transformers renamed the output field and generate's argument ``past_key_values`` to ``cache`` (5.2x)
CACHE_FIELD = next((f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput) if f.name == "cache"),
                   "past_key_values")


def token_columns(prompt_mask: torch.Tensor | None, rows: int, prompt_width: int, length: int) -> torch.Tensor:
    """``(B, length)`` int64: which of a row's tokens (its index in llmplug's unpadded sequence) sits at each column of
    stock's padded layout, -1 at padding columns.

    Args:
        prompt_mask: ``(B, prompt_width)`` the prompts' attention mask (None: nothing padded).
        rows: ``B``.
        prompt_width: the padded prompt length ``W``; columns from ``W`` on hold generated tokens.
        length: columns wanted.
    """
    real = torch.ones(rows, prompt_width, dtype=torch.bool) if prompt_mask is None else prompt_mask.bool().cpu()
    prompt = torch.where(real, real.long().cumsum(1) - 1, -1)
    generated = real.sum(1, keepdim=True) + torch.arange(max(0, length - prompt_width))
    return torch.cat([prompt, generated], dim=1)[:, :length]


def fill_hf_cache(cache, runner, seqs, prompt_mask: torch.Tensor | None, prompt_width: int, length: int) -> None:
    """Write the first ``length`` columns of every layer's K/V of ``seqs`` into HF's empty ``cache`` (``update``, so
    sliding-window layers keep what stock's keep), as ``(B, Hkv, length, D)`` in the model's dtype; padding columns
    are zeros (stock holds the KV of pad tokens there, which every later step masks out).

    Args:
        cache: HF ``Cache`` prepared by ``generate``, still empty.
        runner: the model's :class:`~llmplug.engine.runner.ModelRunner`.
        seqs: the call's :class:`~llmplug.engine.sequences.SequenceBatch` (its pages hold every column's KV).
        prompt_mask, prompt_width: as in :func:`token_columns`.
    """
    rows = len(seqs)
    columns = token_columns(prompt_mask, rows, prompt_width, length)
    pad = columns < 0
    pos = columns.clamp_min(0)
    size = seqs.block_size
    tables = seqs.block_table.long()
    dev = runner.device
    blocks = tables.gather(1, pos // size).to(dev)
    offsets = (pos % size).to(dev)
    pad = pad.to(dev)[:, :, None, None]
    for layer in range(runner.num_layers):
        k_pages, v_pages, k_scale, v_scale = runner.cache.layer(layer)
        k, v = (read_pages_ref(p, s, blocks, offsets, runner.dtype).masked_fill(pad, 0)
                for p, s in ((k_pages, k_scale), (v_pages, v_scale)))
        cache.update(k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), layer)
