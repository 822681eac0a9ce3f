"""How many draft tokens a step should verify: the expected tokens a step against what the longer step costs.

With per-draft acceptance ``a``, a step verifying ``k`` drafts emits ``(1 - a^(k+1)) / (1 - a)`` tokens on average
(Leviathan et al.). Its cost grows with the tokens it computes only once the step stops being bound by the weight
read: ``max(1, T / ridge)`` for ``T`` tokens, where ``ridge`` is the token count at which the matmuls' work catches up
with the weight read (the GPU's FLOP rate over its bandwidth, ~300 tokens on an H100 in bf16; a CPU is compute-bound
almost at once). A fixed ``overhead`` stands for what a verify step costs beyond that (attention over ``1 + k``
queries, the host's acceptance check). ``k = 0`` turns speculation off for a block of ``probe_every`` plain decode
steps (on CUDA one replay of the greedy graph each, read once), then one verify step at ``k_max`` probes acceptance
again, so a turn for the better is noticed.
"""

from __future__ import annotations


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify step of ``k`` drafts emits on average at per-draft acceptance ``alpha``."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class AdaptiveK:
    """Chooses each step's draft count from the acceptance measured so far in this call.

    Args:
        k_max: the most drafts a step verifies (the user's ``k``).
        ridge: tokens a step computes before it becomes compute-bound.
        overhead: relative extra cost of any verify step over a plain decode step.
        prior: acceptance assumed before anything is measured.
        probe_every: tokens of the block of plain decode steps between two probes at ``k_max`` while speculation is
            off.
    """

    def __init__(self, k_max: int, ridge: float, overhead: float = 0.08, prior: float = 0.6,
                 probe_every: int = 16) -> None:
        if k_max < 1:
            raise ValueError(f"k={k_max} draft tokens: must be >= 1")
        self.k_max, self.ridge, self.overhead, self.probe_every = k_max, ridge, overhead, probe_every
        self.drafted = 0.0
        self.accepted = 0.0
        self.prior = prior
        self._probe_next = False

    @property
    def alpha(self) -> float:
        """Per-draft acceptance: an exponential average over recent steps (weight 1 / 8 a step), the prior at first."""
        return self.prior if self.drafted < 1 else self.accepted / self.drafted

    def record(self, drafted: int, accepted: int) -> None:
        """One step's drafts and how many were accepted (over every row)."""
        if drafted:
            self.drafted = 0.875 * self.drafted + drafted
            self.accepted = 0.875 * self.accepted + accepted

    def choose(self, rows: int) -> int:
        """Drafts for the next step of ``rows`` sequences (0: a plain decode step)."""
        base = max(1.0, rows / self.ridge)
        best_k, best = 0, 1.0
        for k in range(1, self.k_max + 1):
            cost = max(1.0, rows * (1 + k) / self.ridge) / base * (1.0 + self.overhead)
            value = expected_tokens(self.alpha, k) / cost
            if value > best:
                best_k, best = k, value
        if best_k == 0:  # off: a block of plain steps (``probe_every`` tokens), then one probe at k_max
            self._probe_next = not self._probe_next
            return self.k_max if not self._probe_next else 0
        return best_k
