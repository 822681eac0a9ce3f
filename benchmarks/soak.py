"""Soak test of ``llmplug.Engine``: thousands of requests arriving over time into a KV pool small enough to force
preemptions, ~10% aborted at random moments, every request checked against its output when run alone.

Each request has a random prompt (some share a prefix, for prefix-cache hits), a random ``max_new_tokens``, and is
greedy (most; some with ``n=2``, some with penalties and ``min_new_tokens``, some speculating with prompt lookup or a
draft model, the model's first layer, whose own small pool must end empty too) or sampled with a seed; some stop at
eos or at a few stop token ids. Requests arrive a few per step; an aborted request is aborted before it starts,
mid-prefill or mid-decode. After every step the block accounting is checked (held blocks = blocks of unfinished
sequences, swap slots = slots of swapped ones); at the end every block must be back. A request that finished is
compared with the same prompt and parameters run through an idle engine with a big pool (``--reference batched``: all
at once, no preemption; a mismatch is re-checked alone before it counts), alone one by one (``--reference alone``) or,
for greedy requests without OpenAI-style penalties, with stock HF ``generate`` at batch 1 (``--reference hf``). An
aborted request's tokens must be a prefix of its reference.

Usage: python benchmarks/soak.py [--requests 5000] [--mode recompute|swap|both] [--device cpu|cuda] [--seed 0]

Exits 1 on any mismatch, leaked block or stall. CPU runs the tiny fp32 model on llmplug's reference ops (one thread);
CUDA runs the same model in fp32 on the Triton kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug import Engine, EngineConfig, SamplingParams, SpeculativeConfig  # noqa: E402
from llmplug.engine.request import Status  # noqa: E402
from llmplug.ops._triton import cpu_kernels  # noqa: E402
from llmplug.state import state_of  # noqa: E402
from tests.tiny_models import make_model  # noqa: E402


@dataclass
class SoakConfig:
    """One soak run. ``num_blocks`` pages of ``block_size`` tokens; prompts ``1..max_prompt``, outputs
    ``1..max_new`` tokens; ``arrival`` requests per step on average."""

    requests: int = 5000
    mode: str = "recompute"
    device: str = "cpu"
    seed: int = 0
    family: str = "llama"
    max_prompt: int = 48
    max_new: int = 32
    num_blocks: int = 24
    block_size: int = 8
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 32
    arrival: float = 1.5
    abort_rate: float = 0.1
    shared_prefix_rate: float = 0.25
    sampled_rate: float = 0.1
    penalty_rate: float = 0.1
    n2_rate: float = 0.05
    greedy_ring: int = 16  # EngineConfig.greedy_ring (off by default in the Engine; the soak exercises it)
    spec_rate: float = 0.25  # share of plain greedy requests that speculate (1-4 drafts)
    draft_rate: float = 0.5  # share of those that draft with a draft model (the model's first layer), not prompt lookup
    eos_rate: float = 0.2
    stop_rate: float = 0.2
    priorities: int = 3
    policy: str = "priority"
    watermark: float = 0.01
    swap_blocks: int = 12
    reference: str = "batched"


@dataclass
class SoakReport:
    config: SoakConfig
    finished: int = 0
    aborted: int = 0
    checked: int = 0
    steps: int = 0
    preemptions: int = 0
    swapped_out: int = 0
    prefix_hit_rate: float = 0.0
    drafted: int = 0  # draft tokens verified by speculating requests
    ring_blocks: int = 0  # blocks of greedy decode steps read at once (EngineConfig.greedy_ring)
    ring_steps: int = 0
    soak_s: float = 0.0
    reference_s: float = 0.0
    reference_noise: int = 0  # batched reference differed from the alone run, soak output equal to alone
    mismatches: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.leaks

    def summary(self) -> str:
        c = self.config
        lines = [f"soak: {c.requests} requests, mode={c.mode}, device={c.device}, seed={c.seed}, pool={c.num_blocks}"
                 f"x{c.block_size} tokens, reference={c.reference}",
                 f"  finished {self.finished}, aborted {self.aborted}, checked {self.checked}, steps {self.steps}, "
                 f"preemptions {self.preemptions}, sequences swapped out {self.swapped_out}, "
                 f"prefix hit rate {self.prefix_hit_rate:.2f}, drafts verified {self.drafted}, greedy ring blocks "
                 f"{self.ring_blocks} ({self.ring_steps} steps)",
                 f"  soak {self.soak_s:.1f} s, reference {self.reference_s:.1f} s, "
                 f"batched-reference noise {self.reference_noise}",
                 f"  mismatches {len(self.mismatches)}, leaks {len(self.leaks)}: {'OK' if self.ok else 'FAILED'}"]
        lines += [f"  MISMATCH {m}" for m in self.mismatches[:20]]
        lines += [f"  LEAK {m}" for m in self.leaks[:20]]
        return "\n".join(lines)


@dataclass
class _Job:
    prompt: list[int]
    params: SamplingParams
    arrive: int  # step at which it is added
    abort_after: int | None  # steps after arrival at which it is aborted (None: never)
    rid: str = ""


def _jobs(cfg: SoakConfig, vocab: int, max_len: int, draft: torch.nn.Module | None = None) -> list[_Job]:
    rng = random.Random(cfg.seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.choice((8, 16, 24)))] for _ in range(4)]
    jobs, step = [], 0
    for i in range(cfg.requests):
        step += int(rng.expovariate(cfg.arrival))
        n = rng.randint(1, cfg.max_prompt)
        head = rng.choice(prefixes) if rng.random() < cfg.shared_prefix_rate else []
        prompt = (head + [rng.randrange(3, vocab) for _ in range(n)])[:max(n, len(head) + 1)]
        new = min(rng.randint(1, cfg.max_new), max_len - len(prompt))
        kind = rng.random()
        stops = tuple(rng.sample(range(3, vocab), 4)) if rng.random() < cfg.stop_rate else ()
        common = dict(max_new_tokens=new, ignore_eos=rng.random() >= cfg.eos_rate, stop_token_ids=stops,
                      priority=rng.randrange(cfg.priorities))
        if kind < cfg.sampled_rate:
            params = SamplingParams(temperature=rng.choice((0.7, 1.0, 1.3)), top_k=rng.choice((0, 20)),
                                    top_p=rng.choice((1.0, 0.9)), seed=rng.randrange(1 << 30),
                                    n=rng.choice((1, 2)), **common)
        elif kind < cfg.sampled_rate + cfg.penalty_rate:
            params = SamplingParams(temperature=0.0, repetition_penalty=rng.choice((1.0, 1.2, 1.5)),
                                    frequency_penalty=rng.choice((0.0, 0.5)), presence_penalty=rng.choice((0.0, 0.3)),
                                    min_new_tokens=min(rng.choice((0, 2)), new), **common)
        else:
            spec = None
            if rng.random() < cfg.spec_rate:  # half with a fixed draft count (a CPU's estimate turns drafting off)
                how = dict(method="draft", draft_model=draft) if draft is not None and rng.random() < cfg.draft_rate \
                    else {}
                spec = SpeculativeConfig(num_tokens=rng.randint(1, 4), adaptive=rng.random() < 0.5, **how)
            params = SamplingParams(temperature=0.0, n=2 if kind > 1 - cfg.n2_rate else 1, speculative=spec, **common)
        abort = rng.choice((0, rng.randint(1, 4), rng.randint(5, 40))) if rng.random() < cfg.abort_rate else None
        jobs.append(_Job(prompt, params, step, abort, f"soak_{i}"))
    return jobs


def _engine(stock: torch.nn.Module, num_blocks: int, cfg: SoakConfig, **overrides) -> Engine:
    fast = copy.deepcopy(stock)
    fast.generation_config.eos_token_id = 2
    llmplug.optimize(fast, kv_num_blocks=num_blocks, kv_block_size=cfg.block_size)
    engine_cfg = dict(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                      policy=cfg.policy, watermark=cfg.watermark, preemption_mode=cfg.mode, greedy_ring=cfg.greedy_ring)
    engine_cfg.update(overrides)
    if engine_cfg["preemption_mode"] == "swap":
        cache = state_of(fast).runner.ensure_cache()
        engine_cfg["swap_space_gb"] = cfg.swap_blocks * cache.block_bytes / 1e9
    return Engine(fast, EngineConfig(**engine_cfg))


def _draft_model(stock: torch.nn.Module, cfg: SoakConfig) -> torch.nn.Module:
    """The stock model's first layer alone (its other weights shared), on llmplug with a pool as small as the target's:
    it agrees with the model sometimes, and its pool runs short, so rows go without drafts."""
    draft = make_model(cfg.family, num_hidden_layers=1).to(stock.device)
    own = draft.state_dict()
    draft.load_state_dict({k: v for k, v in stock.state_dict().items() if k in own and own[k].shape == v.shape},
                          strict=False)
    return llmplug.optimize(draft, kv_num_blocks=cfg.num_blocks, kv_block_size=cfg.block_size)


def _check_accounting(engine: Engine) -> str | None:
    """Held blocks are exactly those of unfinished sequences; swap slots exactly those of swapped ones."""
    sched, blocks = engine.scheduler, engine.blocks
    live = [s for r in list(engine._requests.values()) for s in r.seqs if s.status is not Status.FINISHED]
    held: dict[int, int] = {}
    for seq in live:
        for b in seq.blocks:
            held[b] = held.get(b, 0) + 1
    if any(s.blocks for s in sched.waiting + sched.swapped):
        return "a waiting or swapped sequence holds device blocks"
    if held != blocks.ref:
        return f"block refcounts {len(blocks.ref)} blocks / {sum(blocks.ref.values())} refs differ from the " \
               f"unfinished sequences' {len(held)} / {sum(held.values())}"
    if blocks.num_used + blocks.num_free != blocks.num_total:
        return f"used {blocks.num_used} + free {blocks.num_free} != total {blocks.num_total}"
    if sched.swap is not None:
        slots = sum(len(s.swap_slots) for s in live)
        if sched.swap.allocator.num_blocks - sched.swap.allocator.num_free != slots:
            return f"swap slots in use {sched.swap.allocator.num_blocks - sched.swap.allocator.num_free} != {slots}"
    return None


def _tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def run_soak(cfg: SoakConfig, stall_steps: int = 500) -> SoakReport:
    """Run one soak; the report lists every mismatch and leak."""
    report = SoakReport(cfg)
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    stock = make_model(cfg.family).to(device)
    stock.generation_config.eos_token_id = None
    vocab = stock.get_output_embeddings().weight.shape[0]
    max_len = min(256, stock.config.max_position_embeddings)
    draft = _draft_model(stock, cfg) if cfg.spec_rate and cfg.draft_rate else None
    jobs = _jobs(cfg, vocab, max_len, draft)
    ctx = cpu_kernels(False) if device.type == "cpu" else contextlib.nullcontext()
    with ctx:
        engine = _engine(stock, cfg.num_blocks, cfg)
        outputs = _drive(engine, jobs, report, stall_steps)
        report.preemptions = engine.scheduler.num_preemptions
        report.prefix_hit_rate = engine.stats()["prefix_hit_rate"]
        report.drafted = engine.speculation.drafted
        stats = engine.stats()
        report.ring_blocks, report.ring_steps = stats["ring_blocks"], stats["ring_steps"]
        problem = _check_accounting(engine)
        if problem or engine.blocks.num_used or engine.blocks.num_free != engine.blocks.num_total:
            report.leaks.append(f"after the run: {problem or ''} used {engine.blocks.num_used}, free "
                                f"{engine.blocks.num_free} of {engine.blocks.num_total}")
        if engine.has_unfinished_requests():
            report.leaks.append(f"{len(engine._requests)} requests never finished")
        if engine.speculation.live:
            report.leaks.append(f"the engine counts {engine.speculation.live} speculating requests after the run")
        draft_pool = state_of(draft).runner.cache if draft is not None else None
        if draft_pool is not None and draft_pool.blocks.num_used:
            report.leaks.append(f"the draft model's pool holds {draft_pool.blocks.num_used} blocks after the run")
        t0 = time.perf_counter()
        _compare(stock, jobs, outputs, cfg, report)
        report.reference_s = time.perf_counter() - t0
    return report


def _drive(engine: Engine, jobs: list[_Job], report: SoakReport, stall_steps: int) -> dict:
    outputs: dict[str, object] = {}
    aborts: dict[int, list[str]] = {}
    next_job, step, idle = 0, 0, 0
    swapped_before: set[int] = set()
    t0 = time.perf_counter()
    while next_job < len(jobs) or engine.has_unfinished_requests():
        while next_job < len(jobs) and jobs[next_job].arrive <= step:
            job = jobs[next_job]
            engine.add_request(job.prompt, job.params, request_id=job.rid)
            if job.abort_after is not None:
                aborts.setdefault(step + job.abort_after, []).append(job.rid)
            next_job += 1
        for rid in aborts.pop(step, []):
            if rid not in outputs:
                engine.abort(rid)
        done = engine.step()
        for out in done:
            outputs[out.request_id] = out
        swapped = {id(s) for s in engine.scheduler.swapped}
        report.swapped_out += len(swapped - swapped_before)
        swapped_before = swapped
        problem = _check_accounting(engine)
        if problem:
            report.leaks.append(f"step {step}: {problem}")
            break
        idle = 0 if done or engine.scheduler.running else idle + 1
        if idle >= stall_steps or step > 100 * len(jobs) + 1000:
            report.leaks.append(f"stalled at step {step}: {len(engine.scheduler.waiting)} waiting, "
                                f"{len(engine.scheduler.swapped)} swapped, {len(engine.scheduler.running)} running, "
                                f"{idle} steps without progress")
            break
        step += 1
    report.steps = step
    report.soak_s = time.perf_counter() - t0
    return outputs


def _alone(ref: Engine, job: _Job):
    return ref.generate(job.prompt, job.params, progress=False)[0]


def _hf_comparable(p: SamplingParams) -> bool:
    return p.greedy and not p.frequency_penalty and not p.presence_penalty  # HF has no OpenAI-style penalties


def _hf(stock: torch.nn.Module, job: _Job) -> list[list[int]]:
    p = job.params
    eos = list(p.stop_token_ids) + ([] if p.ignore_eos else [2])
    gc = GenerationConfig(max_new_tokens=p.max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=eos or None,
                          repetition_penalty=p.repetition_penalty, min_new_tokens=p.min_new_tokens)
    ids = torch.tensor([job.prompt], device=stock.device)
    return [stock.generate(ids, generation_config=gc)[0, len(job.prompt):].tolist()] * p.n


def _compare(stock: torch.nn.Module, jobs: list[_Job], outputs: dict, cfg: SoakConfig, report: SoakReport) -> None:
    """Each finished request equals its reference; an aborted one is a prefix of it."""
    big = 16 * cfg.max_num_seqs * -(-(cfg.max_prompt + 24 + cfg.max_new) // cfg.block_size)
    ref = _engine(stock, big, cfg, max_num_seqs=256, max_num_batched_tokens=4096, preemption_mode="recompute")
    todo = [j for j in jobs if j.rid in outputs]
    if cfg.reference == "batched":
        got = ref.generate([j.prompt for j in todo], [j.params for j in todo], progress=False)
        want = {j.rid: _tokens(o) for j, o in zip(todo, got)}
    elif cfg.reference == "hf":
        todo = [j for j in todo if _hf_comparable(j.params)]
        want = {j.rid: _hf(stock, j) for j in todo}
    else:
        want = {j.rid: _tokens(_alone(ref, j)) for j in todo}
    for job in todo:
        out = outputs[job.rid]
        reasons = {c.finish_reason for c in out.outputs}
        if reasons & {"error", None}:
            report.mismatches.append(f"{job.rid}: finish reasons {reasons}, error {out.error}")
            continue
        got, expect = _tokens(out), want[job.rid]
        aborted = "abort" in reasons
        report.aborted += aborted
        report.finished += not aborted
        same = _agrees(got, expect, aborted)
        if not same and cfg.reference == "batched":
            alone = _tokens(_alone(ref, job))
            if _agrees(got, alone, aborted):
                report.reference_noise += 1
                same = True
            expect = alone
        report.checked += 1
        if not same:
            report.mismatches.append(f"{job.rid}: prompt {len(job.prompt)} tokens, {job.params}, finish {reasons}: "
                                     f"got {got} want {expect}")
    missing = [j.rid for j in jobs if j.rid not in outputs]
    if missing:
        report.leaks.append(f"{len(missing)} requests have no output: {missing[:5]}")


def _agrees(got: list[list[int]], want: list[list[int]], aborted: bool) -> bool:
    if not aborted:
        return got == want
    return len(got) <= len(want) and all(g == w[:len(g)] for g, w in zip(got, want))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--mode", choices=("recompute", "swap", "both"), default="both")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", choices=("batched", "alone", "hf"), default="batched")
    ap.add_argument("--family", default=SoakConfig.family, help="a tiny model family of tests/tiny_models.py")
    ap.add_argument("--num-blocks", type=int, default=SoakConfig.num_blocks)
    ap.add_argument("--max-num-batched-tokens", type=int, default=SoakConfig.max_num_batched_tokens)
    ap.add_argument("--max-num-seqs", type=int, default=SoakConfig.max_num_seqs)
    ap.add_argument("--watermark", type=float, default=SoakConfig.watermark)
    ap.add_argument("--policy", choices=("fcfs", "priority"), default=SoakConfig.policy)
    ap.add_argument("--abort-rate", type=float, default=SoakConfig.abort_rate)
    ap.add_argument("--penalty-rate", type=float, default=SoakConfig.penalty_rate,
                    help="share of greedy requests with repetition/frequency/presence penalties")
    ap.add_argument("--spec-rate", type=float, default=SoakConfig.spec_rate,
                    help="share of plain greedy requests that speculate with prompt lookup")
    ap.add_argument("--arrival", type=float, default=SoakConfig.arrival,
                    help="requests arriving per step on average (low rates leave the running batch alone, so the "
                         "greedy ring runs)")
    ap.add_argument("--draft-rate", type=float, default=SoakConfig.draft_rate,
                    help="share of speculating requests that draft with a draft model instead of prompt lookup")
    ap.add_argument("--greedy-ring", type=int, default=SoakConfig.greedy_ring, help="EngineConfig.greedy_ring")
    ap.add_argument("--sampled-rate", type=float, default=SoakConfig.sampled_rate, help="share of sampled requests")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny matmuls: 1 is fastest)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    ok = True
    for mode in ("recompute", "swap") if args.mode == "both" else (args.mode,):
        cfg = SoakConfig(requests=args.requests, mode=mode, device=args.device, seed=args.seed,
                         reference=args.reference, family=args.family, num_blocks=args.num_blocks,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                         watermark=args.watermark, policy=args.policy, abort_rate=args.abort_rate,
                         penalty_rate=args.penalty_rate, spec_rate=args.spec_rate, draft_rate=args.draft_rate,
                         arrival=args.arrival, sampled_rate=args.sampled_rate, greedy_ring=args.greedy_ring)
        report = run_soak(cfg)
        print(report.summary(), flush=True)
        ok &= report.ok and report.preemptions > 0
        if report.preemptions == 0:
            print("  FAILED: the pool never forced a preemption; use a smaller --num-blocks")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

