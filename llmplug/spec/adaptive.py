"""How many draft tokens a step should verify: the expected tokens a step against what the longer step costs.

With per-draft acceptance ``a``, a step verifying ``k`` drafts emits ``(1 - a^(k+1)) / (1 - a)`` tokens on average
(Leviathan et al.). What a step of ``q = 1 + k`` tokens a row costs is measured as the call goes (wall time, the
proposals and the host's bookkeeping included; the first step of each shape is left out, as it may capture a graph). A
shape not measured yet is estimated from the measured ones: piecewise linearly in ``q`` through the plain step and the
measured verify steps, or, before any verify step was timed, from a weight-bound model: ``max(1, T / ridge)`` for
``T`` tokens, where ``ridge`` is the token count at which the matmuls' work catches up with the weight read (~300 on
an H100 in bf16; a CPU is compute-bound almost at once), plus a fixed ``overhead``. ``k = 0`` turns speculation off
for blocks of ``probe_every`` plain decode steps (on CUDA one replay of the greedy graph each, read once), then one
verify step at ``k_max`` probes acceptance again; each probe that finds speculation still not paying doubles the
number of blocks before the next one (up to ``max_backoff``), so a turn for the better is noticed and a hopeless call
pays little for looking.
"""

from __future__ import annotations

# NOTE: tokens at which a step's matmuls catch up with its weight read (bf16 FLOP rate / read bandwidth, ~230 on an
# H100); a CPU is compute-bound at once. The estimate before a shape's cost is measured.
RIDGE_TOKENS = {"cuda": 256.0, "cpu": 4.0}


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify step of ``k`` drafts emits on average at per-draft acceptance ``alpha``."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class AdaptiveK:
    """Chooses each step's draft count from the acceptance and step costs measured so far in this call.

    Args:
        k_max: the most drafts a step verifies (the user's ``k``).
        ridge: tokens a step computes before it becomes compute-bound (the estimate before anything is timed).
        overhead: relative extra cost of any verify step over a plain decode step (same).
        prior: acceptance assumed before anything is measured.
        probe_every: tokens of a block of plain decode steps while speculation is off.
        max_backoff: most blocks of plain steps between two probes.
        agree: maps each measured time to the one to use (under tensor parallelism rank 0's, so that every rank
            chooses the same draft counts and runs the same steps); None keeps it.
    """

    def __init__(self, k_max: int, ridge: float, overhead: float = 0.08, prior: float = 0.6,
                 probe_every: int = 16, max_backoff: int = 8, agree=None) -> None:
        if k_max < 1:
            raise ValueError(f"k={k_max} draft tokens: must be >= 1")
        self.k_max, self.ridge, self.overhead, self.probe_every = k_max, ridge, overhead, probe_every
        self.max_backoff = max_backoff
        self.agree = agree  # measured times -> the ones every rank uses (rank 0's under tensor parallelism)
        self.drafted = 0.0
        self.accepted = 0.0
        self.prior = prior
        self.costs: dict[tuple[int, int], float] = {}  # (rows, q) -> seconds a step (EMA)
        self._seen: set[tuple[int, int]] = set()
        self._blocks_left = 0  # plain blocks still to run before the next probe
        self._backoff = 1  # plain blocks between probes now
        self._probing = False  # the last choice was a probe
        self._on = True  # speculating (the last choice had drafts, or nothing was chosen yet)
        self._skip = 0  # choose_step: plain steps left in the current block

    @property
    def alpha(self) -> float:
        """Per-draft acceptance: an exponential average over recent steps (weight 1 / 8 a step), the prior at first."""
        return self.prior if self.drafted < 1 else self.accepted / self.drafted

    def record(self, drafted: int, accepted: int) -> None:
        """One step's drafts and how many were accepted (over every row)."""
        if drafted:
            self.drafted = 0.875 * self.drafted + drafted
            self.accepted = 0.875 * self.accepted + accepted

    def record_cost(self, rows: int, q: int, seconds: float) -> None:
        """The wall time of one step of ``rows`` sequences, ``q`` tokens each (a plain step: ``q = 1``)."""
        if self.agree is not None:
            seconds = self.agree(seconds)
        key = (rows, q)
        if key not in self._seen:  # the first may have captured a graph or compiled a kernel
            self._seen.add(key)
            return
        old = self.costs.get(key)
        self.costs[key] = seconds if old is None else 0.75 * old + 0.25 * seconds

    def cost(self, rows: int, q: int) -> float:
        """A step of ``q`` tokens a row relative to a plain step (measured, else estimated)."""
        plain = self.costs.get((rows, 1))
        if plain is not None:
            points = sorted((m, c / plain) for (r, m), c in self.costs.items() if r == rows)  # (1, 1.0) first
            if len(points) > 1:
                below = max(p for p in points if p[0] <= q)
                above = min((p for p in points if p[0] >= q), default=None)
                if above is None:  # past the longest measured step: on the line from the plain step through it
                    below, above = points[0], points[-1]
                if above[0] == below[0]:
                    return below[1]
                return below[1] + (above[1] - below[1]) * (q - below[0]) / (above[0] - below[0])
        base = max(1.0, rows / self.ridge)
        return max(1.0, rows * q / self.ridge) / base * (1.0 + self.overhead)

    def choose_step(self, rows: int) -> int:
        """:meth:`choose` for a caller that asks before every step (the Engine): a 0 holds for the ``probe_every``
        steps of its block of plain steps."""
        if self._skip:
            self._skip -= 1
            return 0
        k = self.choose(rows)
        if k == 0:
            self._skip = self.probe_every - 1
        return k

    def choose(self, rows: int) -> int:
        """Drafts for the next step of ``rows`` sequences (0: a block of plain decode steps)."""
        best_k, best = 0, 1.0
        for k in range(1, self.k_max + 1):
            value = expected_tokens(self.alpha, k) / self.cost(rows, 1 + k)
            if value > best:
                best_k, best = k, value
        if best_k:
            self._on, self._backoff, self._probing = True, 1, False
            return best_k
        if self._on:  # just turned off: one block, then a probe
            self._on, self._blocks_left = False, self._backoff
        elif self._probing:  # the probe found speculation still not paying: wait longer before the next
            self._backoff = min(2 * self._backoff, self.max_backoff)
            self._blocks_left = self._backoff
        self._probing = False
        if self._blocks_left > 0:
            self._blocks_left -= 1
            return 0
        self._probing = True
        return self.k_max
