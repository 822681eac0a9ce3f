"""What speculative decoding did: per call, read back with :func:`spec_stats`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpecStats:
    """One ``generate`` call's speculation: verify steps, drafts proposed and accepted, tokens emitted; per row the
    steps it took part in and the tokens it gained."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    per_row_steps: list[int] = field(default_factory=list)
    per_row_emitted: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a row gained per step it took part in (1.0 without speculation)."""
        taken = sum(self.per_row_steps)
        return sum(self.per_row_emitted) / taken if taken else 0.0

    def per_row(self) -> list[float]:
        """Tokens per step of each row."""
        return [e / s if s else 0.0 for e, s in zip(self.per_row_emitted, self.per_row_steps)]


def spec_stats(model: torch.nn.Module) -> SpecStats | None:
    """The :class:`SpecStats` of ``model``'s last speculative ``generate`` call (None before one, or when the model is
    not optimized)."""
    from ..state import state_of

    state = state_of(model)
    return None if state is None else state.spec_stats
