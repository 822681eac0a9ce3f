"""The one step builder and the runner's one entry point: uniform steps of ``1 + k`` tokens a row (speculative
verifies) attend to their cached context and to each other exactly as the model's own forward (fp32 CPU,
references)."""

import pytest
import torch

import llmplug
from llmplug.engine.sequences import SequenceBatch
from llmplug.engine.step import build_step
from llmplug.ops._triton import cpu_kernels
from llmplug.state import state_of
from tests.tiny_models import make_model, pad, prompts


@pytest.fixture(autouse=True)
def _references():
    with cpu_kernels(False):
        yield


def _pair(family):
    stock = make_model(family)
    fast = make_model(family)
    fast.load_state_dict(stock.state_dict())
    stock.set_attn_implementation("eager")
    return stock, llmplug.optimize(fast)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
@pytest.mark.parametrize("query_len", [1, 3, 5])
@pytest.mark.parametrize("all_logits", [True, False])
def test_uniform_step_equals_the_models_forward(family, query_len, all_logits):
    stock, fast = _pair(family)
    runner = state_of(fast).runner
    lengths = (5, 17, 9)  # 17: the step's tokens cross a page boundary (pages of 16)
    ids, mask = pad(prompts(3, lengths=lengths))
    batch = SequenceBatch(runner, ids, mask, max_length=40, prefix_cache=False)
    try:
        batch.prefill()
        g = torch.Generator().manual_seed(query_len)
        new = torch.randint(0, 128, (3, query_len), generator=g)
        batch._grow(range(3), [n + query_len for n in lengths])
        ctx = build_step(batch.seqs, [query_len] * 3, batch.block_size, ids.device, input_ids=new.reshape(-1),
                         block_tables=batch.block_table_dev, all_logits=all_logits)
        assert ctx.query_len == query_len and ctx.meta is None and ctx.row_starts == [0, query_len, 2 * query_len]
        got = runner.step(ctx)
    finally:
        batch.release()
    want = []
    for row, m, extra in zip(ids, mask.bool(), new):
        logits = stock(input_ids=torch.cat([row[m], extra])[None]).logits[0, -query_len:]
        want.append(logits if all_logits else logits[-1:])
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-4, atol=1e-4)


def test_build_step_packs_rows_that_differ():
    _, fast = _pair("llama")
    runner = state_of(fast).runner
    ids, mask = pad(prompts(3, lengths=(5, 17, 9)))
    batch = SequenceBatch(runner, ids, mask, max_length=40, prefix_cache=False)
    try:
        seqs = batch.seqs
        batch._grow(range(3), [2, 17, 9])
        ctx = build_step(seqs, [2, 1, 9], batch.block_size, ids.device, block_tables=batch.block_table_dev)
        assert ctx.query_len == 0 and ctx.row_starts == [0, 2, 3]
        assert ctx.positions.tolist() == [0, 1, 0] + list(range(9))
        assert ctx.meta.num_decodes == 0 and ctx.meta.max_seqlen_q == 9 and ctx.logits_indices.tolist() == [1, 2, 11]
        ctx = build_step(seqs[1:], [1, 9], batch.block_size, ids.device, block_tables=batch.block_table_dev[1:])
        assert ctx.meta.num_decodes == 1  # a leading one-token row attends on the decode kernel
        uniform = build_step(seqs, [4, 4, 4], batch.block_size, ids.device, block_tables=batch.block_table_dev)
        assert uniform.query_len == 4 and uniform.positions.tolist() == [0, 0, 0]
        assert uniform.input_ids.tolist() == [t for s in seqs for t in s.tokens[:4]]
        assert uniform.logits_indices.tolist() == [3, 7, 11]
        dev_ids, dev_pos = torch.tensor([7, 8, 9]), torch.tensor([4, 20, 11])
        on_device = build_step(seqs, [1, 1, 1], batch.block_size, ids.device, block_tables=batch.block_table_dev,
                               input_ids=dev_ids, positions=dev_pos)
        assert on_device.input_ids is dev_ids and on_device.positions is dev_pos  # nothing read from the rows
        with pytest.raises(ValueError, match="positions= is for uniform steps"):
            build_step(seqs, [2, 1, 9], batch.block_size, ids.device, input_ids=torch.zeros(12, dtype=torch.long),
                       positions=dev_pos)
        with pytest.raises(ValueError, match="positions= is for uniform steps"):
            build_step(seqs, [1, 1, 1], batch.block_size, ids.device, positions=dev_pos)
    finally:
        batch.release()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_uniform_graph_replay_equals_the_models_forward_cuda(family):
    """A verify-shaped step (3 rows, 1 + 4 tokens each) replays the graph of (rows bucket 4, query length 5) and its
    logits match the model's own forward."""
    stock, fast = _pair(family)
    stock.cuda()
    llmplug.unoptimize(fast)
    llmplug.optimize(fast.cuda(), graph_batch_sizes=(1, 4))
    runner = state_of(fast).runner
    lengths = (5, 17, 9)
    ids, mask = pad(prompts(3, lengths=lengths))
    ids, mask = ids.cuda(), mask.cuda()
    batch = SequenceBatch(runner, ids, mask, max_length=40, prefix_cache=False)
    try:
        batch.prefill()
        new = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(0)).cuda()
        batch._grow(range(3), [n + 5 for n in lengths])
        ctx = build_step(batch.seqs, [5] * 3, batch.block_size, ids.device, input_ids=new.reshape(-1),
                         block_tables=batch.block_table_dev, all_logits=True)
        got = runner.step(ctx).clone()  # a view of the graph's output buffer
        assert ("step", 4, 5) in runner._graphs
        again = runner.step(ctx)  # the same step once more: its KV slots are overwritten with the same values
    finally:
        batch.release()
    assert torch.equal(got, again)
    want = torch.cat([stock(input_ids=torch.cat([row[m], extra])[None]).logits[0, -5:]
                      for row, m, extra in zip(ids, mask.bool(), new)])
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_arm_token_loop_loads_a_buckets_buffers():
    """The token-loop graphs' buffers (generate's ring and the Engine's) loaded for 2 rows of a 4-row bucket: inputs,
    positions, pages and flags in the first rows, padding (position -1, not unfinished) after, eos ids padded with -1,
    counters zeroed; a single flag value fills every row; position limits where given, none elsewhere."""
    from llmplug.engine.runner import MAX_EOS, NO_LIMIT, ModelRunner

    buf = {"input_ids": torch.full((4,), 9), "positions": torch.full((4,), 9), "unfinished": torch.ones(4, dtype=bool),
           "eos": torch.full((MAX_EOS,), 9), "pad": torch.full((1,), 9), "counters": torch.full((2,), 9),
           "block_tables": torch.full((4, 6), 9, dtype=torch.int32), "limits": torch.full((4,), 9)}
    tables = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    ModelRunner.arm_token_loop(buf, torch.tensor([7, 8]), torch.tensor([30, 40]), tables, torch.tensor([True, False]),
                               torch.tensor([2, 5]), 0)
    assert buf["input_ids"][:2].tolist() == [7, 8] and buf["positions"].tolist() == [30, 40, -1, -1]
    assert buf["limits"].tolist() == [NO_LIMIT] * 4
    assert buf["unfinished"].tolist() == [True, False, False, False] and buf["pad"].tolist() == [0]
    assert buf["eos"].tolist() == [2, 5] + [-1] * (MAX_EOS - 2) and buf["counters"].tolist() == [0, 0]
    assert buf["block_tables"][:2, :3].tolist() == tables.tolist()
    ModelRunner.arm_token_loop(buf, torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]), tables[[0, 1, 1]], True,
                               torch.empty(0, dtype=torch.long), 2)
    assert buf["unfinished"].tolist() == [True, True, True, False] and buf["eos"].tolist() == [-1] * MAX_EOS
    ModelRunner.arm_token_loop(buf, torch.tensor([1, 2]), torch.tensor([5, 6]), tables, True,
                               torch.empty(0, dtype=torch.long), 0, torch.tensor([8, 7]))
    assert buf["limits"].tolist() == [8, 7, NO_LIMIT, NO_LIMIT]
