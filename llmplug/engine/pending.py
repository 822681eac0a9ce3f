"""A launched step whose sampled tokens the host has not seen yet: the Engine's one step in flight."""

from __future__ import annotations

import functools

import torch

from .host_read import HostRead

PLACEHOLDER = -1  # a sampled token the host has not seen yet


class PendingStep:
    """A launched step: ``tokens (R,)`` on the device, sampled for ``seqs`` at token ``indices`` (each sequence's
    placeholder there until resolved)."""

    def __init__(self, seqs: list, indices: list[int], tokens: torch.Tensor) -> None:
        self.seqs, self.indices, self.tokens = seqs, indices, tokens
        self.read = HostRead(tokens)
        # (R,) on the device when the step decoded exactly these rows: their positions in it (the next step's minus 1)
        self.positions: torch.Tensor | None = None

    @functools.cached_property
    def row_of(self) -> dict[int, int]:
        """``id(seq)`` -> its row in ``tokens``."""
        return {id(s): r for r, s in enumerate(self.seqs)}

    def last_index(self, row: int) -> int:
        """The index, in its sequence's tokens, of the token ``tokens[row]`` holds."""
        return self.indices[row]

    def values(self) -> list:
        return self.read.values()
