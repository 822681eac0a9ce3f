"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the sequence's tail.

On input-grounded text (code edits, summaries, retrieval-augmented answers) the continuation often copies a span of
the prompt; matching the last ``n`` tokens against the sequence so far finds it, with no model at all. Tried from
``max_ngram`` down to ``min_ngram`` tokens; the longest tail with a match wins, and among its matches the latest.
HF's ``prompt_lookup_num_tokens`` is ``k`` and ``max_matching_ngram_size`` is ``max_ngram``.
"""

from __future__ import annotations

import torch

__all__ = ["propose_ngram"]


def propose_ngram(tokens: torch.Tensor, k: int, max_ngram: int = 2, min_ngram: int = 1) -> torch.Tensor:
    """Up to ``k`` draft tokens for the sequence ``tokens (L,)`` int64 (any device); ``(0,)`` when nothing matches.

    Raises:
        ValueError: ``k < 1`` or ``1 <= min_ngram <= max_ngram`` does not hold.
    """
    if k < 1 or not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need k >= 1 and 1 <= min_ngram <= max_ngram, got k={k}, min_ngram={min_ngram}, "
                         f"max_ngram={max_ngram}")
    length = tokens.numel()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # windows starting at 0 .. L - n - 1: every occurrence that ends before the tail itself and has a successor
        windows = tokens[:length - 1].unfold(0, n, 1)
        hits = (windows == tokens[length - n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return tokens[:0]
