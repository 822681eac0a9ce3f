"""Serving workloads of the throughput benchmark (token-id prompts from a seeded RNG, output lengths, arrival times)
and their physical floor: the time an ideal engine needs for them at the measured ceilings.

Every workload takes a ``scale`` > 0: the number of requests and every length are multiplied by it (at least 1
each), so the whole suite runs in seconds on a CPU with a tiny model and at full size on a GPU.
"""

from __future__ import annotations

import dataclasses

import torch

from .shapes import weight_bytes

__all__ = ["NAMES", "ModelCost", "Workload", "build", "floor", "online"]

NAMES = {"a": "mixed", "b": "decode-heavy", "c": "prefill-heavy", "d": "shared prefix", "e": "online"}
_FIRST_ID = 3  # token ids below this are left out (pad / bos / eos of the usual configs)


@dataclasses.dataclass
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


# ---- the physical floor ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelCost:
    """What one token costs a dense decoder.

    Attributes:
        weight_bytes: bytes a decode step reads (``shapes.weight_bytes``: every weight once, one embedding row).
        body_params: matmul parameters outside the lm_head (2 FLOPs each per token).
        head_params: lm_head parameters (2 FLOPs each per sampled row).
        kv_bytes_per_token: K and V of one token over all layers, ``2 * L * Hkv * D * elem``.
        attn_flops_per_pair: FLOPs of one query-key pair over all layers (QK^T and PV), ``4 * L * H * D``.
    """

    weight_bytes: int
    body_params: int
    head_params: int
    kv_bytes_per_token: int
    attn_flops_per_pair: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelCost:
        """The cost of a stock (not yet optimized) HF model."""
        text = model.config.get_text_config()
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        elem = next(model.parameters()).element_size()
        wb = weight_bytes(model)
        head = model.get_output_embeddings().weight.numel()
        layers = text.num_hidden_layers
        return cls(wb, wb // elem - head, head, 2 * layers * kv_heads * head_dim * elem, 4 * layers * heads * head_dim)


def prefill_flops(cost: ModelCost, prompt_len: int, cached: int = 0) -> int:
    """FLOPs to prefill ``prompt_len - cached`` tokens after ``cached`` ones and sample the last row."""
    new = prompt_len - cached
    pairs = (prompt_len * (prompt_len + 1) - cached * (cached + 1)) // 2  # sum of c for c in cached+1 .. prompt_len
    return 2 * cost.body_params * new + 2 * cost.head_params + cost.attn_flops_per_pair * pairs


def floor(cost: ModelCost, prompt_lens: list[int], output_lens: list[int], read_bw: float, matmul_rate: float,
          max_num_seqs: int, cached: list[int] | None = None, arrivals: list[float] | None = None) -> dict:
    """Physical floor of a run, in seconds, and its parts.

    ::

        floor_s = sum_r F_pre(r) / R + sum_s max(B_s / BW, F_s / R)
        F_pre(r) = 2 N_body (p_r - c_r) + 2 N_head + A * sum_{j = c_r + 1}^{p_r} j
        B_s = W + K * sum_{r in S_s} ctx_r(s)
        F_s = sum_{r in S_s} (2 (N_body + N_head) + A * ctx_r(s))

    with ``p_r`` / ``o_r`` request r's prompt / output tokens, ``c_r`` its prompt tokens an ideal prefix cache already
    holds, ``W`` weight bytes, ``K`` KV bytes per token, ``A`` attention FLOPs per query-key pair, ``N_body`` /
    ``N_head`` matmul parameters outside / in the lm_head (:class:`ModelCost`), ``BW`` the measured read bandwidth
    and ``R`` the measured matmul rate. The first output token comes from the prefill; request r then needs decode
    steps k = 1 .. o_r - 1, each over ``ctx_r = p_r + k`` tokens. The ideal schedule runs requests in order, up to
    ``max_num_seqs`` at once, all running requests decode in every step ``s`` (set ``S_s``), and a waiting request
    joins the step after one finishes. With ``arrivals`` (online runs) the floor is also at least the arrival span
    plus the last request's own floor, run alone.
    """
    cached = cached or [0] * len(prompt_lens)
    pre = sum(prefill_flops(cost, p, c) for p, c in zip(prompt_lens, cached))
    decode_s, steps = _decode_floor(cost, prompt_lens, output_lens, read_bw, matmul_rate, max_num_seqs)
    out = {"prefill_flops": pre, "prefill_s": pre / matmul_rate, "decode_s": decode_s, "decode_steps": steps}
    out["floor_s"] = out["prefill_s"] + decode_s
    if arrivals:
        last = max(range(len(arrivals)), key=arrivals.__getitem__)
        alone = floor(cost, [prompt_lens[last]], [output_lens[last]], read_bw, matmul_rate, 1)["floor_s"]
        out["arrival_bound_s"] = arrivals[last] - min(arrivals) + alone
        out["floor_s"] = max(out["floor_s"], out["arrival_bound_s"])
    return out


def _decode_floor(cost: ModelCost, prompt_lens: list[int], output_lens: list[int], read_bw: float, matmul_rate: float,
                  max_num_seqs: int) -> tuple[float, int]:
    """Seconds and steps of the ideal decode schedule of :func:`floor`."""
    waiting = [(p, o - 1) for p, o in zip(prompt_lens, output_lens) if o > 1][::-1]
    running: list[list[int]] = []  # [context, decode steps left]
    per_row = 2 * (cost.body_params + cost.head_params)
    total, steps = 0.0, 0
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            running.append(list(waiting.pop()))
        ctx = 0
        for r in running:
            r[0] += 1
            r[1] -= 1
            ctx += r[0]
        nbytes = cost.weight_bytes + cost.kv_bytes_per_token * ctx
        flops = per_row * len(running) + cost.attn_flops_per_pair * ctx
        total += max(nbytes / read_bw, flops / matmul_rate)
        steps += 1
        running = [r for r in running if r[1] > 0]
    return total, steps
