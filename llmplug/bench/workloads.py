"""Serving workloads of the throughput benchmark: token-id prompts from a seeded RNG, output lengths, arrival times.

Every workload takes a ``scale`` > 0: the number of requests and every length are multiplied by it (at least 1
each), so the whole suite runs in seconds on a CPU with a tiny model and at full size on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["NAMES", "Workload", "build", "online"]

NAMES = {"a": "mixed", "b": "decode-heavy", "c": "prefill-heavy", "d": "shared prefix", "e": "online"}
_FIRST_ID = 3  # token ids below this are left out (pad / bos / eos of the usual configs)


@dataclass
class Workload:
    """A list of requests: ``prompts[i]`` (token ids) generates ``output_lens[i]`` tokens.

    Attributes:
        key: ``"a"`` ... ``"e"``.
        description: what it is, at this scale.
        shared_prefix_len: leading tokens every prompt has in common (workload d), else 0.
        arrivals: seconds after the start at which each request arrives (online runs), else None (all at once).
    """

    key: str
    description: str
    prompts: list[list[int]]
    output_lens: list[int]
    shared_prefix_len: int = 0
    arrivals: list[float] | None = None

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def head(self, n: int) -> Workload:
        """The first ``n`` requests."""
        arrivals = None if self.arrivals is None else self.arrivals[:n]
        return Workload(self.key, self.description, self.prompts[:n], self.output_lens[:n], self.shared_prefix_len,
                        arrivals)


def scaled(x: int, scale: float) -> int:
    """``x * scale`` rounded, at least 1."""
    return max(1, round(x * scale))


def _tokens(n: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(_FIRST_ID, vocab, (n,), generator=g).tolist()


def mixed(vocab: int, scale: float = 1.0, seed: int = 0, requests: int = 256) -> Workload:
    """(a) ``requests`` prompts of uniform length in [32, 1024], 256 new tokens each."""
    g = torch.Generator().manual_seed(seed)
    n, lo, hi, out = scaled(requests, scale), scaled(32, scale), scaled(1024, scale), scaled(256, scale)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return Workload("a", f"mixed: {n} requests, prompts {lo}-{hi}, {out} out",
                    [_tokens(k, vocab, g) for k in lengths], [out] * n)


def decode_heavy(vocab: int, scale: float = 1.0, seed: int = 1) -> Workload:
    """(b) 128 prompts of 32 tokens, 2048 new tokens each."""
    g = torch.Generator().manual_seed(seed)
    n, p, out = scaled(128, scale), scaled(32, scale), scaled(2048, scale)
    return Workload("b", f"decode-heavy: {n} requests, {p} in / {out} out", [_tokens(p, vocab, g) for _ in range(n)],
                    [out] * n)


def prefill_heavy(vocab: int, scale: float = 1.0, seed: int = 2) -> Workload:
    """(c) 32 prompts of 4096 tokens, 32 new tokens each."""
    g = torch.Generator().manual_seed(seed)
    n, p, out = scaled(32, scale), scaled(4096, scale), scaled(32, scale)
    return Workload("c", f"prefill-heavy: {n} requests, {p} in / {out} out", [_tokens(p, vocab, g) for _ in range(n)],
                    [out] * n)


def shared_prefix(vocab: int, scale: float = 1.0, seed: int = 3) -> Workload:
    """(d) 256 prompts: one 2000-token system prompt + 64 unique tokens each, 128 new tokens each."""
    g = torch.Generator().manual_seed(seed)
    n, shared, own, out = scaled(256, scale), scaled(2000, scale), scaled(64, scale), scaled(128, scale)
    prefix = _tokens(shared, vocab, g)
    return Workload("d", f"shared prefix: {n} requests, {shared} shared + {own} own tokens, {out} out",
                    [prefix + _tokens(own, vocab, g) for _ in range(n)], [out] * n, shared_prefix_len=shared)


def online(vocab: int, rate: float, scale: float = 1.0, seed: int = 4, requests: int = 128) -> Workload:
    """(e) ``requests`` requests of (a)'s distribution arriving as a Poisson process of ``rate`` requests/s.

    The first request arrives at 0. Every rate draws the same prompts and the same unit-rate gaps (divided by
    ``rate``), so runs at different rates differ only in how fast the requests come.
    """
    base = mixed(vocab, scale, seed, requests)
    g = torch.Generator().manual_seed(seed + 1)
    gaps = torch.empty(len(base.prompts) - 1, dtype=torch.float64).exponential_(1.0, generator=g) / rate
    arrivals = [0.0] + torch.cumsum(gaps, 0).tolist()
    return Workload("e", f"online {rate:g} req/s: {base.description.removeprefix('mixed: ')}", base.prompts,
                    base.output_lens, arrivals=arrivals)


_OFFLINE = {"a": mixed, "b": decode_heavy, "c": prefill_heavy, "d": shared_prefix}


def build(key: str, vocab: int, scale: float = 1.0, seed: int | None = None) -> Workload:
    """Offline workload ``key`` (``"a"`` ... ``"d"``); ``seed`` None takes the workload's own default."""
    if key not in _OFFLINE:
        raise ValueError(f"workload={key!r} is not one of {sorted(_OFFLINE)} (online runs: workloads.online)")
    if not scale > 0:
        raise ValueError(f"scale={scale!r} must be > 0")
    return _OFFLINE[key](vocab, scale) if seed is None else _OFFLINE[key](vocab, scale, seed)
