"""Packed steps replayed as one CUDA graph per token bucket (attention included) equal the eager forward, and an
Engine serving through them gives stock HF's greedy tokens (fp32, CUDA). The CPU has no graphs; here it checks the
split forward (body, then head) and a step on the graphs' padded metadata against the eager step."""

import copy

import pytest
import torch
from torch._inductor import config as inductor_config

import llmplug
import llmplug.inductor
from llmplug import Engine, EngineConfig, SamplingParams
from llmplug.engine.hf_layers import HFLayers
from llmplug.engine.metadata import AttentionMetadata
from llmplug.engine.packed_graphs import fill_metadata, padded_metadata
from llmplug.engine.sequences import SequenceBatch
from llmplug.engine.step import build_step
from llmplug.ops._triton import INTERPRET, cpu_kernels
from llmplug.state import state_of
from tests.tiny_models import make_model, pad, prompts


def _mixed_step(runner, lengths, news):
    """A :class:`SequenceBatch` of ``prompts(lengths)`` grown for a packed step computing ``news`` tokens a row."""
    ids, mask = pad(prompts(len(lengths), lengths=lengths))
    batch = SequenceBatch(runner, ids, mask, max_length=40, prefix_cache=False)
    batch._grow(range(len(lengths)), news)
    return batch, build_step(batch.seqs, news, batch.block_size, ids.device, block_tables=batch.block_table_dev)


def _forward_and_split(runner, decoder, lengths, news):
    """Logits of a packed step (:func:`_mixed_step`) from the runner's forward and from ``decoder``'s body, then head
    (on the references)."""
    batch, ctx = _mixed_step(runner, lengths, news)
    try:
        with cpu_kernels(False), torch.inference_mode():
            want = runner._forward(ctx.input_ids, ctx.positions, ctx.meta, ctx.logits_indices)
            runner.meta = ctx.meta
            try:
                got = decoder.head(*decoder.body(runner, ctx.input_ids, ctx.positions), ctx.logits_indices)
            finally:
                runner.meta = None
    finally:
        batch.release()
    return want, got


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gpt2", "olmo2"])
def test_body_then_head_equals_the_forward(family):
    """The layers' body, then the head, give the forward's logits bit for bit: the fused families' decoder and any
    other model's (uncompiled) :class:`HFLayers`."""
    model = llmplug.optimize(make_model(family))
    runner = state_of(model).runner
    decoder = runner.forward_fn if hasattr(runner.forward_fn, "body") else HFLayers(model, compile=False)
    want, got = _forward_and_split(runner, decoder, (5, 17, 9), [1, 17, 9])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("family, kernels", [("llama", True), ("gemma2", False), ("olmo2", False)])
def test_step_on_padded_metadata_equals_the_step(family, kernels):
    """A packed step (two decode rows, two prompt chunks) run on a bucket's padded metadata (:func:`fill_metadata`:
    more tokens, decode rows and sequences than it has, as a captured graph sees them) gives the eager step's logits on
    its rows; the pad tokens store nothing. On the interpreter's kernels (llama) and the references."""
    model = llmplug.optimize(make_model(family))
    runner = state_of(model).runner
    batch, ctx = _mixed_step(runner, (5, 3, 17, 9), [1, 1, 17, 9])
    t, n = ctx.input_ids.shape[0], 40
    try:
        with cpu_kernels(kernels and INTERPRET):
            want = runner._forward(ctx.input_ids, ctx.positions, ctx.meta, None)
            pages = [x.clone() for x in runner.cache.layer(0)[:2]]
            meta = padded_metadata(n, 3, 4, runner.max_blocks_per_seq, ctx.input_ids.device)
            for buf, junk in ((meta.block_tables, 7), (meta.cu_seqlens_q, 99), (meta.context_lens, 5),
                              (meta.seq_lens, 9), (meta.slot_mapping, 0)):
                buf.fill_(junk)  # an earlier step's values: the fill must overwrite them or pad them away
            fill_metadata(meta, ctx.meta, t)
            ids = torch.cat([ctx.input_ids, torch.full((n - t,), 3)])
            positions = torch.cat([ctx.positions, torch.arange(n - t)])
            got = runner._forward(ids, positions, meta, None)[:t]
            assert all(torch.equal(a, b) for a, b in zip(pages, runner.cache.layer(0)[:2]))  # the step stored again
    finally:
        batch.release()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["olmo2", "gpt2"])
def test_hf_layers_compiled_stack_matches_and_takes_the_passes(family, monkeypatch):
    """In the graphs an HF-path stack runs through torch.compile(backend="llmplug"), the attention breaking its graph:
    logits within the fp32 tolerance of the forward's, and llmplug's norm pass matched in OLMo 2's segments."""
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)  # every graph compiled (and counted) here
    model = llmplug.optimize(make_model(family))
    runner = state_of(model).runner
    layers = HFLayers(model)
    torch._dynamo.reset()
    llmplug.inductor.reset_report()
    want, got = _forward_and_split(runner, layers, (7, 12), [7, 12])
    assert layers.stack is not layers.base  # compiled, not fallen back
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if family == "olmo2":
        assert llmplug.inductor.report()["rms_norm"] > 0


def test_hf_layers_run_uncompiled_where_compile_fails():
    """A stack torch.compile cannot take warns and runs as it is, from then on."""
    model = llmplug.optimize(make_model("gpt2"))
    runner = state_of(model).runner
    layers = HFLayers(model)

    def broken(**kwargs):
        raise RuntimeError("Dynamo says no")

    layers.stack = broken
    ids, positions = torch.arange(3, 9), torch.arange(6)
    runner.ensure_cache()
    runner.meta = AttentionMetadata(query_len=0, slot_mapping=torch.full((6,), -1), block_tables=torch.zeros(
        1, 1, dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32), context_lens=torch.zeros(
        1, dtype=torch.int32), max_seqlen_q=6)
    try:
        with cpu_kernels(False), torch.inference_mode(), runner.llmplug_attention():
            want = layers._run(layers.base, ids, positions)
            with pytest.warns(UserWarning, match="Dynamo says no"):
                got, _ = layers.body(runner, ids, positions)
    finally:
        runner.meta = None
    assert layers.stack is layers.base
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("family, split", [("gpt2", True), ("olmo2", True), ("granite", False)])
def test_hf_layers_are_kept_only_where_they_match_the_forward(family, split):
    """Granite divides its logits by a scale after the lm_head: its split would be wrong, and the check finds it."""
    model = llmplug.optimize(make_model(family))
    with cpu_kernels(False):
        assert HFLayers(model).matches_forward(state_of(model).runner) is split


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gpt2", "olmo2"])
def test_packed_graph_step_equals_the_eager_step_cuda(family):
    """A packed step of a decode row and two prefill rows (27 tokens) replays the 32-token bucket's graph; its logits
    equal the eager step's; twice in a row (pads keep stale values) the same."""
    model = make_model(family).cuda()
    llmplug.optimize(model, packed_graph_tokens=(8, 32), kv_num_blocks=64)
    runner = state_of(model).runner
    assert runner.capture_packed(20, 4) == [8, 32]
    ids, mask = pad(prompts(3, lengths=(6, 17, 9)))
    ids, mask = ids.cuda(), mask.cuda()
    batch = SequenceBatch(runner, ids, mask, max_length=40, prefix_cache=False)
    try:
        batch.prefill()  # then the step computes the first row's last token and the other rows' prompts again
        batch.seqs[0].num_computed = 5
        for s in batch.seqs[1:]:
            s.num_computed = 0
        ctx = build_step(batch.seqs, [1, 17, 9], batch.block_size, ids.device, block_tables=batch.block_table_dev)
        assert runner.packed_graphs.bucket(ctx.meta, 27) == (32, 4)
        want = runner._forward(ctx.input_ids, ctx.positions, ctx.meta, ctx.logits_indices).clone()
        got = runner.step(ctx).clone()
        again = runner.step(ctx)
    finally:
        batch.release()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, again)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "olmo2"])
def test_engine_through_packed_graphs_equals_stock_fp32_cuda(family):
    """An Engine whose packed steps replay graphs (budget 48 tokens: prefill chunks mixed with decodes) gives stock HF's
    greedy tokens, and the graphs ran: a fused family and one through HF's forward."""
    torch.manual_seed(0)
    stock = make_model(family).cuda()
    stock.generation_config.eos_token_id = None
    fast = copy.deepcopy(stock)
    llmplug.optimize(fast, kv_num_blocks=64, kv_block_size=8, graph_batch_sizes=(1, 2, 4, 8),
                     graph_prefill_tokens=(), packed_graph_tokens=(16, 64))
    rows = prompts(6, lengths=(5, 30, 3, 41, 1, 19), seed=4)
    news = [20, 17, 33, 25, 9, 28]
    engine = Engine(fast, EngineConfig(max_num_batched_tokens=48))
    engine.warmup()
    graphs = state_of(fast).runner.packed_graphs
    assert graphs.token_buckets == [16, 64] and (64, 32) in graphs._graphs  # few decode rows, and all
    runs = []
    run = graphs.run
    graphs.run = lambda *a: runs.append(a[-1]) or run(*a)
    outs = engine.generate(rows, [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in news],
                           progress=False)
    assert runs
    for row, n, out in zip(rows, news, outs):
        gc = dict(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
        want = stock.generate(torch.tensor([row], device="cuda"), **gc)[0, len(row):].tolist()
        assert out.outputs[0].token_ids == want
