"""The Engine's greedy ring (blocks of decode steps read once): every greedy output equals stock HF's solo run, with
stop ids and eos stopping rows mid-block, requests arriving and aborted between blocks, a pool that shrinks or skips
blocks, n > 1 forks (copy-on-write), prefix-cache hits on pages the ring filled, streaming; the ring off gives the same
tokens; no block leaks (fp32 CPU, references; the CUDA-graph version is marked gpu)."""

import copy
import random

import pytest
import torch

import llmplug
from llmplug import Engine, EngineConfig, SamplingParams
from llmplug.state import state_of
from tests.engine.test_engine import assert_all_blocks_back, greedy, hf_greedy, make_engine
from tests.tiny_models import make_model, prompts, reference_kernels

ROWS = prompts(5, lengths=(5, 13, 2, 8, 30))
NEW = [20, 7, 33, 16, 25]


def _ring_engine(**kw):
    """:func:`make_engine` with the ring on (``EngineConfig.greedy_ring`` is off by default)."""
    kw.setdefault("greedy_ring", 16)
    return make_engine(**kw)


@pytest.fixture(autouse=True)
def _references():
    with reference_kernels():
        yield


def _spy_reserve(engine: Engine) -> list[tuple[int, int]]:
    """Record each ring reservation as (steps asked, steps granted), checking that a block never reserves a row more
    tokens than it may still generate and that a granted one leaves no row writing into a shared page."""
    calls, reserve, size = [], engine.scheduler.reserve, engine.block_size

    def spy(seqs, n, caps, least=1):
        assert n <= max(s.request.params.max_new_tokens - s.num_output for s in seqs)
        got = reserve(seqs, n, caps, least)
        calls.append((n, got))
        for seq, cap in zip(seqs, caps) if got else ():
            assert min(got, cap) <= seq.request.params.max_new_tokens - seq.num_output
            assert len(seq.blocks) * size >= seq.num_computed + min(got, cap)
            assert not engine.blocks.is_shared(seq.blocks[seq.num_computed // size])
        return got

    engine.scheduler.reserve = spy
    return calls


@pytest.mark.parametrize("ring", [16, 5, 0])
def test_greedy_equals_solo_runs(ring):
    stock, engine = _ring_engine(greedy_ring=ring)
    calls = _spy_reserve(engine)
    outs = engine.generate(ROWS, [greedy(n) for n in NEW], progress=False)
    for row, n, out in zip(ROWS, NEW, outs):
        assert out.outputs[0].token_ids == hf_greedy(stock, row, n)
        assert out.outputs[0].finish_reason == "length"
    stats = engine.stats()
    if ring:  # the ring ran, in blocks of at most `ring` steps
        assert stats["ring_blocks"] == len(calls) > 0 and stats["ring_steps"] == sum(got for _, got in calls)
        assert max(got for _, got in calls) <= ring
    else:
        assert stats["ring_blocks"] == stats["ring_steps"] == 0 and not calls
    assert stats["output_tokens"] == sum(NEW)
    assert_all_blocks_back(engine)


def test_next_block_launches_before_the_last_is_read():
    """While no row joins, block k + 1 starts from block k's tokens on the device and block k is read only after it is
    launched (the GPU never waits for the host's read), rows that reach their length in a block included: they stop
    there on the device and drop out of the next block; the outputs still equal solo runs."""
    stock, engine = _ring_engine(greedy_ring=5)
    events, blocks, launch, resolve = [], [], engine.ring._launch, engine.ring.resolve

    def spy_launch(seqs, counts, n, previous, kept):
        block = launch(seqs, counts, n, previous, kept)
        events.append(("launch", id(block), id(previous) if previous is not None else None))
        blocks.append(block)  # alive, so no later block takes its id
        return block

    def spy_resolve(block, finished):
        events.append(("read", id(block), None))
        resolve(block, finished)

    engine.ring._launch, engine.ring.resolve = spy_launch, spy_resolve
    news = [31, 12]
    outs = engine.generate(ROWS[:2], [greedy(n) for n in news], progress=False)
    for row, n, out in zip(ROWS[:2], news, outs):
        assert out.outputs[0].token_ids == hf_greedy(stock, row, n)
    launches = [e for e in events if e[0] == "launch"]
    # 30 and 11 tokens after the prefill's, 5 a block: the short row (second by context length) computes 1 of the
    # third block's 5, then drops out
    assert [b.counts for b in blocks] == [[5, 5], [5, 5], [1, 5], [5], [5], [5]]
    chained = [e for e in launches if e[2] is not None]
    assert len(chained) == 5  # every block after the first continues from the one before it
    for _, block, previous in chained:
        assert events.index(("read", previous, None)) > events.index(("launch", block, previous))
    assert engine.stats()["ring_steps"] == 30
    assert_all_blocks_back(engine)


def test_a_failed_block_finishes_the_rows_retired_before_it():
    """A block that fails to launch fails its rows' requests; a row of the block before it that reached its length
    (retired, so not in the failed block) still gets its tokens; the engine serves on."""
    stock, engine = _ring_engine(greedy_ring=5)
    launch = engine.ring._launch

    def failing(seqs, counts, n, previous, kept):
        if previous is not None and len(seqs) < len(previous.seqs):
            raise RuntimeError("boom")
        return launch(seqs, counts, n, previous, kept)

    engine.ring._launch = failing
    outs = engine.generate(ROWS[:2], [greedy(31), greedy(12)], progress=False)
    assert outs[0].outputs[0].finish_reason == "error" and "boom" in outs[0].error
    assert outs[0].outputs[0].token_ids == hf_greedy(stock, ROWS[0], 31)[:len(outs[0].outputs[0].token_ids)]
    assert outs[1].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].token_ids == hf_greedy(stock, ROWS[1], 12)
    engine.ring._launch = launch
    assert engine.generate([ROWS[2]], greedy(9), progress=False)[0].outputs[0].token_ids == hf_greedy(stock, ROWS[2], 9)
    assert_all_blocks_back(engine)


def test_stop_ids_and_eos_stop_rows_mid_block():
    """Per-row stop sets: eos (the engine's) and stop_token_ids hit mid-block; an ignore_eos row runs through them."""
    stock = make_model("llama")
    stock.generation_config.eos_token_id = None
    free = [hf_greedy(stock, row, 40) for row in ROWS]
    eos = free[0][6]  # row 0 stops at its 7th token (mid-block) on eos
    stops = [(), (free[1][3],), (free[2][10], free[2][25]), (), (free[4][20],)]
    _, engine = _ring_engine(stock=stock, eos=eos)
    params = [SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=s, ignore_eos=(i == 3))
              for i, s in enumerate(stops)]
    outs = engine.generate(ROWS, params, progress=False)
    for i, (row, p, out) in enumerate(zip(ROWS, params, outs)):
        ids = list(p.stop_token_ids) + ([] if p.ignore_eos else [eos])
        want = hf_greedy(stock, row, 40, eos=ids)
        got = out.outputs[0]
        assert got.token_ids == want, i
        assert got.finish_reason == ("stop" if want[-1] in ids else "length"), i
        assert len(got.token_times) == len(want)
    assert len(outs[0].outputs[0].token_ids) == 7 and outs[3].outputs[0].finish_reason == "length"
    assert engine.stats()["ring_blocks"] > 0
    assert_all_blocks_back(engine)


def test_arrivals_and_aborts_between_blocks():
    """A request added while blocks run waits for the block to end, is prefilled (no block that step) and joins the
    next block; an aborted one keeps the tokens it had; the others equal their solo runs."""
    stock, engine = _ring_engine()
    ids = [engine.add_request(r, greedy(n)) for r, n in zip(ROWS[:3], (40, 40, 40))]
    done = {}
    for _ in range(3):
        done.update({o.request_id: o for o in engine.step()})
    blocks = engine.stats()["ring_blocks"]
    assert blocks >= 1
    late = engine.add_request(ROWS[3], greedy(30))
    engine.abort(ids[1])
    out = engine.step()  # the abort is delivered; the newcomer is waiting: a plain step prefills it
    done.update({o.request_id: o for o in out})
    assert ids[1] in done and engine.stats()["ring_blocks"] == blocks
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    assert engine.stats()["ring_blocks"] > blocks
    aborted = done[ids[1]].outputs[0]
    assert aborted.finish_reason == "abort" and 2 <= len(aborted.token_ids) < 40
    assert aborted.token_ids == hf_greedy(stock, ROWS[1], 40)[:len(aborted.token_ids)]
    for rid, row, n in ((ids[0], ROWS[0], 40), (ids[2], ROWS[2], 40), (late, ROWS[3], 30)):
        assert done[rid].outputs[0].token_ids == hf_greedy(stock, row, n)
    assert_all_blocks_back(engine)


def test_small_pool_shrinks_or_skips_blocks():
    """Pages for a whole block are taken up front without preempting: a tight pool shrinks blocks or skips them (the
    plain steps then preempt as usual); outputs still equal solo runs."""
    rows = prompts(8, lengths=(6, 3, 9, 5), seed=1)
    news = [18, 22, 9, 14, 20, 11, 16, 19]
    stock, engine = _ring_engine(num_blocks=8, block_size=8, max_num_seqs=4, watermark=0.0)
    calls = _spy_reserve(engine)
    outs = engine.generate(rows, [greedy(n) for n in news], progress=False)
    for row, n, out in zip(rows, news, outs):
        assert out.outputs[0].token_ids == hf_greedy(stock, row, n)
    assert any(2 <= got < asked for asked, got in calls), calls  # shrunk
    assert any(got == 0 for _, got in calls), calls  # skipped
    assert engine.stats()["ring_blocks"] == sum(got > 0 for _, got in calls)
    assert_all_blocks_back(engine)


def test_forks_copy_on_write_and_prefix_hits_on_ring_blocks():
    """n = 2 greedy samples share the prompt's last partial page until the ring copies it; a later prompt that
    continues an earlier output hits the pages the ring filled and registered."""
    stock, engine = _ring_engine(block_size=8)
    calls = _spy_reserve(engine)
    first = engine.generate([ROWS[1]], SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, n=2),
                            progress=False)[0]
    want = hf_greedy(stock, ROWS[1], 30)
    assert [c.token_ids for c in first.outputs] == [want, want]
    assert calls and calls[0][1] >= 2  # the first block ran right after the fork
    follow = ROWS[1] + want[:21]
    hits = engine.stats()["prefix_hit_tokens"]
    out = engine.generate([follow], greedy(12), progress=False)[0]
    assert engine.stats()["prefix_hit_tokens"] - hits >= 32  # pages holding ring tokens were found
    assert out.outputs[0].token_ids == hf_greedy(stock, follow, 12)
    assert_all_blocks_back(engine)


def test_rows_ending_at_max_model_len():
    stock = make_model("llama")
    stock.generation_config.eos_token_id = None
    fast = copy.deepcopy(stock)
    llmplug.optimize(fast, kv_num_blocks=32, kv_block_size=8, max_model_len=40)
    engine = Engine(fast, EngineConfig(greedy_ring=16))
    outs = engine.generate([ROWS[4], ROWS[0]], [greedy(10), greedy(35)], progress=False)
    assert outs[0].outputs[0].token_ids == hf_greedy(stock, ROWS[4], 10)
    assert outs[1].outputs[0].token_ids == hf_greedy(stock, ROWS[0], 35)
    assert engine.stats()["ring_blocks"] > 0
    assert_all_blocks_back(engine)


def test_streaming_deltas_are_unchanged():
    """A streaming request rides the ring: the same one-token deltas as plain steps give, a block's all at once (its
    tokens share one time)."""
    got, stock = {}, None
    for ring in (16, 0):
        stock, engine = _ring_engine(stock=stock, greedy_ring=ring)
        events = []
        engine.add_request(ROWS[0], greedy(40), on_event=events.append)
        while engine.has_unfinished_requests():
            engine.step()
        *deltas, final = events
        got[ring] = [(d.token_ids, d.finished, d.finish_reason) for d in deltas]
        assert [t for d in deltas for t in d.token_ids] == final.outputs[0].token_ids == hf_greedy(stock, ROWS[0], 40)
        assert len(set(final.outputs[0].token_times)) == (4 if ring else 40)  # the first token, then 16 + 16 + 7
    assert got[16] == got[0] and len(got[0]) == 40


def test_sampled_penalised_or_stop_string_neighbours_keep_plain_steps():
    """A request the ring cannot serve (sampled, penalised, min_new_tokens left) keeps every step plain while it
    runs; greedy neighbours still equal their solo runs."""
    for other in (SamplingParams(max_new_tokens=30, temperature=0.8, seed=0, ignore_eos=True),
                  SamplingParams(max_new_tokens=30, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
                  SamplingParams(max_new_tokens=30, temperature=0.0, min_new_tokens=30, ignore_eos=True)):
        stock, engine = _ring_engine()
        outs = engine.generate(ROWS[:3], [greedy(20), other, greedy(25)], progress=False)
        assert outs[0].outputs[0].token_ids == hf_greedy(stock, ROWS[0], 20)
        assert outs[2].outputs[0].token_ids == hf_greedy(stock, ROWS[2], 25)
        assert engine.stats()["ring_blocks"] == 0, other
        assert_all_blocks_back(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_mix_against_solo_runs(mode):
    """40 greedy requests (random lengths, stop ids, eos) arriving over time into a pool that forces preemptions,
    random aborts: every finished output equals its solo run, aborted ones are prefixes, no block leaks."""
    rng = random.Random(0)
    stock = make_model("llama")
    stock.generation_config.eos_token_id = None
    rows = prompts(40, lengths=(3, 17, 8, 30, 5, 12), seed=2)
    _, engine = _ring_engine(stock=stock, num_blocks=20, block_size=8, max_num_batched_tokens=32, preemption_mode=mode,
                            swap_space_gb=0.01)
    _spy_reserve(engine)
    jobs = []
    for row in rows:
        stops = tuple(rng.sample(range(3, 128), 6)) if rng.random() < 0.5 else ()
        jobs.append((row, SamplingParams(max_new_tokens=rng.randint(2, 40), temperature=0.0, stop_token_ids=stops,
                                         ignore_eos=rng.random() < 0.5)))
    done, ids, aborted = {}, {}, set()
    while len(ids) < len(jobs) or engine.has_unfinished_requests():
        for _ in range(rng.choice((0, 0, 1, 2))):
            if len(ids) < len(jobs):
                row, p = jobs[len(ids)]
                ids[engine.add_request(row, p)] = len(ids)
        live = [r for r in ids if r not in done and r not in aborted]
        if live and rng.random() < 0.04:
            victim = rng.choice(live)
            aborted.add(victim)
            engine.abort(victim)
        done.update({o.request_id: o for o in engine.step()})
    stats = engine.stats()
    assert stats["ring_blocks"] > 0 and engine.scheduler.num_preemptions > 0
    for rid, i in ids.items():
        row, p = jobs[i]
        want = hf_greedy(stock, row, p.max_new_tokens, eos=list(p.stop_token_ids) + ([] if p.ignore_eos else [2]))
        got = done[rid].outputs[0]
        if got.finish_reason == "abort":
            assert got.token_ids == want[:len(got.token_ids)], rid
        else:
            assert got.token_ids == want, rid
    assert_all_blocks_back(engine)


def test_bad_greedy_ring():
    for bad in (-1, 17, 2.0, True):
        with pytest.raises(ValueError, match="greedy_ring="):
            EngineConfig(greedy_ring=bad)


@pytest.mark.gpu
def test_ring_on_cuda_graphs_equals_stock_fp32():
    """On CUDA the blocks replay the greedy graph (per rows bucket): fp32 outputs equal stock HF's solo runs and the
    ring off, with stop ids mid-block, forks and several rows buckets."""
    torch.manual_seed(0)
    stock = make_model("llama").cuda()
    stock.generation_config.eos_token_id = None
    fast = copy.deepcopy(stock)
    llmplug.optimize(fast, kv_num_blocks=64, kv_block_size=8, graph_batch_sizes=(1, 2, 4, 8))
    rows = prompts(7, lengths=(5, 30, 3, 12, 1, 8, 19), seed=4)
    news = [40, 17, 33, 25, 9, 40, 28]

    def solo(row, n, eos=None):
        gc = dict(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=eos)
        return stock.generate(torch.tensor([row], device="cuda"), **gc)[0, len(row):].tolist()

    free = [solo(r, n) for r, n in zip(rows, news)]
    stops = [(free[i][n // 2],) if i % 2 else () for i, n in enumerate(news)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, stop_token_ids=s)
              for n, s in zip(news, stops)]
    for ring in (16, 0):
        engine = Engine(fast, EngineConfig(max_num_batched_tokens=32, greedy_ring=ring))
        engine.warmup()
        outs = engine.generate(rows, params, progress=False)
        for row, p, out in zip(rows, params, outs):
            assert out.outputs[0].token_ids == solo(row, p.max_new_tokens, list(p.stop_token_ids) or None)
        assert (engine.stats()["ring_blocks"] > 0) == bool(ring)
        assert engine.blocks.num_used == 0
    assert ("greedy", 8) in state_of(fast).runner._graphs
    forked = Engine(fast, EngineConfig(greedy_ring=16)).generate(rows[:2], SamplingParams(max_new_tokens=30,
                                                                                         temperature=0.0,
                                                                            ignore_eos=True, n=3), progress=False)
    for row, out in zip(rows, forked):
        assert [c.token_ids for c in out.outputs] == [solo(row, 30)] * 3
