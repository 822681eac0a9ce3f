"""Serving metrics: per-request latencies, throughput, goodput, KV use, prefix hits, preemptions."""

from __future__ import annotations

import operator
import statistics

from ..kv.prefix_cache import BlockManager
from .params import EngineConfig
from .request import RequestOutput

_BLOCKS, _COMPUTED = operator.attrgetter("blocks"), operator.attrgetter("num_computed")


def percentiles(values: list[float]) -> dict[str, float | None]:
    """``p50``, ``p95``, ``p99`` and ``mean`` of ``values`` (None when empty)."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def at(q: float) -> float:  # linear interpolation between closest ranks
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"p50": at(0.5), "p95": at(0.95), "p99": at(0.99), "mean": statistics.fmean(ordered)}


class EngineMetrics:
    """Collects what :meth:`Engine.stats` reports; every time is ``time.perf_counter()`` seconds."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.reset()

    def reset(self) -> None:
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.itl: list[float] = []
        self.e2e: list[float] = []
        self.good = 0
        self.finished = 0
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.steps = 0
        self.ring_blocks = 0
        self.ring_steps = 0
        self.kv_use: list[float] = []
        self.kv_waste_max = 0.0
        self.first_arrival: float | None = None
        self.last_finish: float | None = None

    def on_schedule(self, plan, blocks: BlockManager) -> None:
        """After planning a step: KV utilisation, and waste (held slots no token fills, this step's included)."""
        if not plan.seqs:
            return
        held = blocks.num_used * blocks.block_size
        empty = (blocks.block_size * sum(map(len, map(_BLOCKS, plan.seqs))) - sum(map(_COMPUTED, plan.seqs))
                 - sum(plan.num_new))
        self.kv_use.append(blocks.num_used / blocks.num_total)
        if held:
            self.kv_waste_max = max(self.kv_waste_max, empty / held)

    def on_ring(self, n: int, blocks: BlockManager) -> None:
        """A block of ``n`` greedy decode steps was launched, its pages reserved."""
        self.kv_use.append(blocks.num_used / blocks.num_total)
        self.steps += n
        self.ring_blocks += 1
        self.ring_steps += n

    def on_step(self, plan) -> None:
        """A step was launched (output tokens are counted by the engine as the host receives them)."""
        self.steps += 1
        self.prompt_tokens += sum(n for s, n in zip(plan.seqs, plan.num_new) if s.num_computed <= s.prompt_len)

    def on_finish(self, out: RequestOutput) -> None:
        self.finished += 1
        self.first_arrival = out.arrival_time if self.first_arrival is None else min(self.first_arrival,
                                                                                     out.arrival_time)
        self.last_finish = out.finish_time if self.last_finish is None else max(self.last_finish, out.finish_time)
        if out.first_token_time is None:
            return
        ttft = out.first_token_time - out.arrival_time
        self.ttft.append(ttft)
        self.e2e.append(out.finish_time - out.arrival_time)
        tpots = []
        for c in out.outputs:
            times = c.token_times
            self.itl.extend(map(operator.sub, times[1:], times))
            if len(times) > 1:
                tpots.append((times[-1] - times[0]) / (len(times) - 1))
        tpot = max(tpots) if tpots else 0.0
        self.tpot.extend(tpots)
        if ttft <= self.config.slo_ttft_s and tpot <= self.config.slo_tpot_s and out.error is None:
            self.good += 1

    def summary(self, blocks: BlockManager, preemptions: int) -> dict:
        span = (self.last_finish - self.first_arrival) if self.finished and self.last_finish else 0.0
        rate = (lambda x: x / span) if span > 0 else (lambda x: 0.0)
        return {
            "finished_requests": self.finished,
            "steps": self.steps,
            "ring_blocks": self.ring_blocks,
            "ring_steps": self.ring_steps,
            "ttft_s": percentiles(self.ttft),
            "tpot_s": percentiles(self.tpot),
            "itl_s": percentiles(self.itl),
            "e2e_s": percentiles(self.e2e),
            "output_tokens": self.output_tokens,
            "output_tok_s": rate(self.output_tokens),
            "total_tok_s": rate(self.output_tokens + self.prompt_tokens),
            "goodput_req_s": rate(self.good),
            "slo_attainment": self.good / self.finished if self.finished else 0.0,
            "slo": {"ttft_s": self.config.slo_ttft_s, "tpot_s": self.config.slo_tpot_s},
            "kv_utilisation_mean": sum(self.kv_use) / len(self.kv_use) if self.kv_use else 0.0,
            "kv_utilisation_max": max(self.kv_use, default=0.0),
            "kv_waste_max": self.kv_waste_max,
            "prefix_hit_rate": blocks.stats.hit_rate,
            "prefix_hit_tokens": blocks.stats.hit_tokens,
            "preemptions": preemptions,
        }
