"""Scheduler: decodes first, chunked prefill under the token budget, ``max_num_seqs``, FCFS and priority order,
the watermark, preemption by recompute and by swap (pure Python over a :class:`BlockManager`, then end to end on a
tiny CPU model with a pool small enough to force it); prefix caching and copy-on-write end to end; a CI-sized soak
(``benchmarks/soak.py``)."""

import pytest
import torch

from llmplug import SamplingParams
from llmplug.engine.params import EngineConfig
from llmplug.engine.request import Request, Status
from llmplug.engine.scheduler import Scheduler
from llmplug.kv.allocator import BlockAllocator
from llmplug.kv.cache import PagedKVCache
from llmplug.kv.prefix_cache import BlockManager
from llmplug.kv.swap import SwapSpace
from tests.engine.test_engine import (  # noqa: F401
    _references,
    assert_all_blocks_back,
    greedy,
    hf_greedy,
    make_engine,
    record_plans,
    run_to_end,
)
from tests.tiny_models import prompts

P = 4  # block size of the pure-Python tests


def scheduler(num_blocks: int = 64, swap_blocks: int = 0, **config) -> Scheduler:
    blocks = BlockManager(BlockAllocator(num_blocks), P, enable_prefix_caching=False)
    swap = None
    if swap_blocks:
        cache = PagedKVCache(1, num_blocks, P, 1, 2, torch.float32, torch.device("cpu"))
        cache.k.copy_(torch.arange(cache.k.numel(), dtype=torch.float32).view_as(cache.k))
        cache.v.copy_(-cache.k)
        swap = SwapSpace(cache, swap_blocks)
    return Scheduler(EngineConfig(**config), blocks, swap)


def request(order: int, prompt_len: int, max_new: int = 4, priority: int = 0, n: int = 1):
    params = SamplingParams(max_new_tokens=max_new, priority=priority, n=n, temperature=0.0)
    return Request(f"r{order}", list(range(3, 3 + prompt_len)), params, order=order).seqs[0]


def is_decode(seq, n: int, was: int) -> bool:
    return n == 1 and was == seq.num_tokens - 1 and was > 0


def run(sched: Scheduler, steps: int = 1000, arrivals: dict | None = None, check=None) -> list:
    """Plan and "execute" steps as the engine does (KV computed, one token sampled per finished prompt, sequences
    removed at ``max_new_tokens``); ``arrivals[step]`` are added before that step. Returns ``[(plan, entries)]``
    with ``entries = [(seq, num_new, num_computed before)]``."""
    arrivals = arrivals or {}
    log = []
    for step in range(steps):
        for seq in arrivals.get(step, []):
            sched.add(seq)
        if not sched.has_work() and step > max(arrivals, default=0):
            return log
        plan = sched.schedule()
        entries = [(s, n, s.num_computed) for s, n in zip(plan.seqs, plan.num_new)]
        log.append((plan, entries))
        if check is not None:
            check(sched, plan, entries)
        for seq, n in zip(plan.seqs, plan.num_new):
            seq.num_computed += n
        for seq in plan.seqs:
            if seq.num_computed == seq.num_tokens:
                seq.tokens.append(7)
                if seq.num_tokens - seq.prompt_len >= seq.request.params.max_new_tokens:
                    sched.remove(seq)
    raise AssertionError("scheduler never drained")


def first_scheduled(log) -> list[str]:
    order = []
    for _, entries in log:
        for seq, _, was in entries:
            if was == 0 and seq.request.request_id not in order:
                order.append(seq.request.request_id)
    return order


# ---- pure Python -----------------------------------------------------------------------------------------------------
def test_decodes_first_budget_and_max_num_seqs_on_a_random_workload():
    g = torch.Generator().manual_seed(0)
    arrivals = {}
    for i in range(60):
        step = int(torch.randint(0, 80, (1,), generator=g))
        arrivals.setdefault(step, []).append(
            request(i, int(torch.randint(1, 70, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))))

    def check(sched, plan, entries):
        assert plan.num_tokens <= 24
        assert len(sched.running) <= 5 and len(plan.seqs) <= 5
        kinds = [is_decode(s, n, was) for s, n, was in entries]
        assert kinds == sorted(kinds, reverse=True), "a decode was scheduled after a prefill chunk"
        for s, n, was in entries:
            assert 1 <= n <= s.num_tokens - was and len(s.blocks) * P >= was + n

    log = run(scheduler(num_blocks=256, max_num_batched_tokens=24, max_num_seqs=5), arrivals=arrivals, check=check)
    assert any(n < s.num_tokens - was for _, entries in log for s, n, was in entries), "nothing was chunked"
    assert max(len(plan.seqs) for plan, _ in log) == 5


def test_a_long_prompt_never_stalls_running_decodes():
    sched = scheduler(num_blocks=256, max_num_batched_tokens=16)
    decoders = [request(i, 3, max_new=40) for i in range(4)]
    long = request(9, 200, max_new=2)

    def check(sched, plan, entries):
        running = [s for s in decoders if s.status is Status.RUNNING and s.num_computed > 0]
        assert set(running) <= set(plan.seqs), "a running decode was left out of the step"
        if long in plan.seqs and running:
            i = plan.seqs.index(long)
            assert plan.num_new[i] == min(16 - len(running), long.num_tokens - entries[i][2])

    log = run(sched, arrivals={0: decoders, 2: [long]}, check=check)
    chunks = [n for _, entries in log for s, n, _ in entries if s is long]
    assert len(chunks) > 10 and sum(chunks[:-1]) == 200  # chunked over many steps, then one decode


def test_fcfs_admits_in_arrival_order():
    sched = scheduler(max_num_seqs=2)
    log = run(sched, arrivals={0: [request(i, 5 + i) for i in range(5)]})
    assert first_scheduled(log) == ["r0", "r1", "r2", "r3", "r4"]
    assert all(len(plan.seqs) <= 2 for plan, _ in log)


def test_fcfs_ignores_priority():
    sched = scheduler(max_num_seqs=1, policy="fcfs")
    log = run(sched, arrivals={0: [request(i, 5, priority=5 - i) for i in range(4)]})
    assert first_scheduled(log) == ["r0", "r1", "r2", "r3"]


def test_priority_policy_admits_lower_priority_first():
    sched = scheduler(max_num_seqs=1, policy="priority")
    batch = [request(0, 5, priority=3), request(1, 5, priority=1), request(2, 5, priority=2), request(3, 5, priority=1)]
    log = run(sched, arrivals={0: batch, 3: [request(4, 5, priority=0)]})
    assert first_scheduled(log) == ["r1", "r4", "r3", "r2", "r0"]  # r4 arrives while r1 runs and jumps the queue


def test_watermark_blocks_admission_but_not_a_lone_request():
    def second_admitted(watermark: float) -> bool:
        sched = scheduler(num_blocks=20, watermark=watermark)  # 0.2: keep 4 blocks free beside running sequences
        first = request(0, 40, max_new=20)
        sched.add(first)
        assert sched.schedule().seqs == [first] and sched.blocks.num_free == 10
        first.num_computed = 40
        first.tokens.append(7)
        sched.add(request(1, 25))  # 7 blocks; 9 free once the first decode takes its 11th block
        plan = sched.schedule()
        assert plan.seqs[0] is first
        return len(plan.seqs) == 2

    assert second_admitted(0.0)
    assert not second_admitted(0.2)
    lone = scheduler(num_blocks=20, watermark=0.2)
    lone.add(request(2, 80))  # the whole pool: alone, a request may use all of it
    assert len(lone.schedule().seqs) == 1 and lone.blocks.num_free == 0


def test_recompute_preempts_the_last_sequence_in_policy_order():
    sched = scheduler(num_blocks=10, max_num_batched_tokens=64)
    a, b = request(0, 10, max_new=20), request(1, 10, max_new=20)  # 8 blocks each, 10 in the pool
    preempted = []
    run(sched, arrivals={0: [a, b]}, check=lambda s, plan, e: preempted.extend(plan.preempted))
    assert preempted and set(preempted) == {b} and sched.num_preemptions == len(preempted)
    assert sched.blocks.num_free == 10 and sched.blocks.num_used == 0
    assert a.num_tokens == b.num_tokens == 30


def test_swap_round_trip_keeps_the_kv():
    sched = scheduler(num_blocks=8, swap_blocks=8, preemption_mode="swap", max_num_batched_tokens=64)
    cache = sched.swap.cache
    a, b = request(0, 10, max_new=18), request(1, 9, max_new=18)
    seen = {}

    def check(s, plan, entries):
        for seq in plan.preempted:
            assert seq.status is Status.SWAPPED and not seq.blocks and len(seq.swap_slots) == -(-seq.num_computed // P)
            seen["out"] = (seq, [cache.k[:, blk].clone() for blk in seen["blocks"][:len(seq.swap_slots)]])
        for slots, blocks in plan.swap_in:
            s.swap.swap_in(slots, blocks)
            seq, before = seen["out"]
            assert blocks == seq.blocks[:len(slots)]
            for blk, k in zip(blocks, before):
                assert torch.equal(cache.k[:, blk], k) and torch.equal(cache.v[:, blk], -k)
            seen["in"] = True
        seen["blocks"] = list(b.blocks)

    run(sched, arrivals={0: [a, b]}, check=check)
    assert seen.get("in") and sched.num_preemptions > 0
    assert sched.swap.allocator.num_free == 8 and sched.blocks.num_free == 8


# ---- end to end: preemption ------------------------------------------------------------------------------------------
SWAP_BLOCK_BYTES = 2 * 2 * 8 * 2 * 16 * 4  # K and V, 2 layers, 8 tokens, 2 kv heads, head dim 16, fp32


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_outputs_equal_running_alone(mode, prefix_caching):
    lengths, news = (10, 25, 17, 30, 5, 21), (20, 14, 18, 9, 24, 16)
    stock, engine = make_engine(num_blocks=10, preemption_mode=mode, swap_space_gb=6 * SWAP_BLOCK_BYTES / 1e9,
                                enable_prefix_caching=prefix_caching, max_num_batched_tokens=64)
    if mode == "swap":
        assert engine.scheduler.swap.allocator.num_blocks == 6
    rows = prompts(len(lengths), lengths=lengths)
    plans = record_plans(engine)
    outs = engine.generate(rows, [greedy(n) for n in news], progress=False)
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats()["preemptions"] == engine.scheduler.num_preemptions
    if mode == "swap":
        assert any(swap_in for *_, swap_in, _ in plans), "nothing was swapped back in"
    for row, n, out in zip(rows, news, outs):
        assert out.outputs[0].token_ids == hf_greedy(stock, row, n)
    assert_all_blocks_back(engine)


def test_every_running_decode_is_in_every_engine_step():
    stock, engine = make_engine(num_blocks=64, max_num_batched_tokens=16)
    rows = prompts(4, lengths=(3, 5, 2, 90))
    schedule = engine.scheduler.schedule
    steps = []

    def wrapped():
        decoding = [s for s in engine.scheduler.running if s.num_tokens - s.num_computed == 1]
        plan = schedule()
        contexts = [s.num_computed for s in plan.seqs[:len(decoding)]]
        steps.append((decoding, list(plan.seqs), list(plan.num_new), contexts))
        return plan

    engine.scheduler.schedule = wrapped
    ids = [engine.add_request(r, greedy(25)) for r in rows[:3]]
    engine.step()
    ids.append(engine.add_request(rows[3], greedy(3)))
    done = run_to_end(engine)
    long_steps = 0
    for decoding, seqs, num_new, contexts in steps:
        assert set(seqs[:len(decoding)]) == set(decoding)  # decodes come first,
        assert contexts == sorted(contexts, reverse=True)  # longest context first
        long_steps += any(s.request.request_id == ids[3] and n > 1 for s, n in zip(seqs, num_new))
    assert long_steps >= 6
    assert any(len(set(contexts)) > 1 for *_, contexts in steps)
    for rid, row, n in zip(ids, rows, (25, 25, 25, 3)):
        assert done[rid].outputs[0].token_ids == hf_greedy(stock, row, n)


def test_swapped_sequence_needing_almost_the_whole_pool_comes_back():
    stock, engine = make_engine(num_blocks=10, preemption_mode="swap", swap_space_gb=10 * SWAP_BLOCK_BYTES / 1e9,
                                watermark=0.2, policy="priority")
    a_row, b_row = prompts(2, lengths=(50, 1))
    a = engine.add_request(a_row, greedy(30, priority=1))
    engine.step()
    b = engine.add_request(b_row, greedy(20, priority=0))  # runs first; a is swapped out at 64 tokens (9 blocks)
    done = run_to_end(engine, max_steps=300)
    assert engine.scheduler.num_preemptions > 0
    assert done[a].outputs[0].token_ids == hf_greedy(stock, a_row, 30)
    assert done[b].outputs[0].token_ids == hf_greedy(stock, b_row, 20)


def test_swap_preemption_right_after_copy_on_write():
    stock, engine = make_engine(num_blocks=6, preemption_mode="swap", swap_space_gb=6 * SWAP_BLOCK_BYTES / 1e9,
                                policy="priority", max_num_batched_tokens=16)
    c_row, b_row, a_row = prompts(3, lengths=(3, 21, 40))
    c = engine.add_request(c_row, greedy(4, priority=0))  # keeps every step sampling something
    b = engine.add_request(b_row, greedy(10, n=2, priority=1))  # 2 samples share a partial block after the prompt
    done = {o.request_id: o for o in engine.step()}
    a = engine.add_request(a_row, greedy(5, priority=0))  # its prefill preempts both samples of b, right after b's COW
    plans = record_plans(engine)
    done.update(run_to_end(engine))
    assert plans[1][3] == 2, "the scenario changed: no copy-on-write then preemption in one step"
    assert [x.token_ids for x in done[b].outputs] == [hf_greedy(stock, b_row, 10)] * 2
    assert done[a].outputs[0].token_ids == hf_greedy(stock, a_row, 5)
    assert done[c].outputs[0].token_ids == hf_greedy(stock, c_row, 4)


def max_running(engine, max_steps: int = 300) -> int:
    """Step ``engine`` to the end; the most sequences it ever had running."""
    schedule = engine.scheduler.schedule
    running = [0]

    def wrapped():
        plan = schedule()
        running.append(len(engine.scheduler.running))
        return plan

    engine.scheduler.schedule = wrapped
    run_to_end(engine, max_steps)
    return max(running)


def test_samples_of_n_count_against_max_num_seqs():
    stock, engine = make_engine(max_num_seqs=3)
    a = engine.add_request([5, 6, 7], greedy(4, n=3))
    b = engine.add_request([8, 9], greedy(4))
    schedule = engine.scheduler.schedule

    def wrapped():
        plan = schedule()
        assert len(engine.scheduler.running) <= 3
        return plan

    engine.scheduler.schedule = wrapped
    done = run_to_end(engine, 100)
    assert [c.token_ids for c in done[a].outputs] == [hf_greedy(stock, [5, 6, 7], 4)] * 3
    assert done[b].outputs[0].token_ids == hf_greedy(stock, [8, 9], 4)


def test_more_samples_than_max_num_seqs_are_rejected_or_bounded():
    _, engine = make_engine(max_num_seqs=2)
    try:
        engine.add_request([5, 6, 7], greedy(4, n=3))
    except ValueError as error:
        assert "n=3" in str(error)
        return
    assert max_running(engine) <= 2


# ---- prefix caching --------------------------------------------------------------------------------------------------
def test_prefix_caching_hits_and_matches_caching_off():
    shared = prompts(1, lengths=(40,), seed=3)[0]
    rows = [shared + tail for tail in prompts(5, lengths=(3, 9, 1, 16, 5), seed=4)]
    stock, on = make_engine(num_blocks=48)
    _, off = make_engine(stock=stock, num_blocks=48, enable_prefix_caching=False)
    first = on.generate(rows[0], greedy(6), progress=False)
    assert on.blocks.stats.hit_tokens == 0
    outs_on = first + on.generate(rows[1:], greedy(6), progress=False)
    outs_off = off.generate(rows, greedy(6), progress=False)
    assert [o.outputs[0].token_ids for o in outs_on] == [o.outputs[0].token_ids for o in outs_off]
    assert outs_on[0].outputs[0].token_ids == hf_greedy(stock, rows[0], 6)
    assert on.blocks.stats.hit_tokens >= 4 * 40 // 8 * 8  # every later request reuses the 5 full shared blocks
    assert on.stats()["prefix_hit_rate"] > 0 and on.stats()["prefix_hit_tokens"] == on.blocks.stats.hit_tokens
    assert off.stats()["prefix_hit_rate"] == 0
    assert_all_blocks_back(on)
    assert_all_blocks_back(off)


def test_n_greedy_shares_prompt_blocks_with_copy_on_write():
    stock, engine = make_engine(num_blocks=32, greedy_ring=0)  # plain steps: their plans hold every token and copy
    row = prompts(1, lengths=(21,))[0]  # 21 tokens: the last prompt block is partial and shared by the samples
    plans = record_plans(engine)
    (out,) = engine.generate(row, greedy(9, n=3), progress=False)
    want = hf_greedy(stock, row, 9)
    assert [c.token_ids for c in out.outputs] == [want] * 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert sum(len(copies) for _, copies, *_ in plans) == 2  # two samples copy the shared partial block
    prefill = [n for seqs, *_ in plans for _, n, _ in seqs]
    assert sum(prefill) == 21 + 3 * 8  # the prompt is computed once for the three samples
    stop = want[4]
    (out,) = engine.generate(row, greedy(9, n=2, stop_token_ids=(stop,)), progress=False)
    assert [c.token_ids for c in out.outputs] == [hf_greedy(stock, row, 9, eos=[stop])] * 2
    assert [c.finish_reason for c in out.outputs] == ["stop", "stop"]
    assert_all_blocks_back(engine)


def test_prefix_stats_count_each_admission_once():
    _, engine = make_engine(num_blocks=10, watermark=0.3)  # 3 blocks kept free beside a running request
    a = prompts(1, lengths=(50,))[0]
    engine.add_request(a, greedy(10))  # 7 blocks, then 8
    engine.step()
    engine.add_request(a[:16] + [3], greedy(3))  # shares 2 full blocks with a, waits for a to finish
    run_to_end(engine)
    assert engine.scheduler.num_preemptions == 0
    assert (engine.blocks.stats.queried_tokens, engine.blocks.stats.hit_tokens) == (50 + 17, 16)


# ---- CI-sized soak ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, reference", [("recompute", "alone"), ("swap", "hf")])
def test_soak(mode, reference):
    from benchmarks.soak import SoakConfig, run_soak

    report = run_soak(SoakConfig(requests=200, mode=mode, seed=1, max_prompt=24, max_new=12, num_blocks=12,
                                 reference=reference))
    assert report.preemptions > 0 and report.aborted > 10 and report.checked > 150 and report.drafted > 0
    assert report.mismatches == [] and report.leaks == []
    if mode == "swap":
        assert report.swapped_out > 0
