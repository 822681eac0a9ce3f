"""The greedy verify graph (ModelRunner.greedy_verify) returns what the eager verify step and greedy_accept return
(CUDA, fp32)."""

import pytest
import torch

import llmplug
from llmplug.engine.sequences import SequenceBatch
from llmplug.engine.step import build_step
from llmplug.spec.rejection import greedy_accept
from llmplug.state import state_of
from tests.engine.test_engine_spec import _copying
from tests.tiny_models import make_model, pad, prompts


@pytest.mark.gpu
def test_greedy_verify_graph_equals_the_eager_step():
    """Three rows of a model that repeats its input (drafts of the last token get accepted): a row with 4 right drafts,
    one whose second draft is wrong, one without drafts; the graph's result equals the eager step's acceptance, and
    replaying it again gives the same."""
    torch.manual_seed(0)
    model = _copying(make_model("llama", tie_word_embeddings=True)).cuda()
    llmplug.optimize(model, graph_batch_sizes=(1, 4))
    runner = state_of(model).runner
    lengths = (5, 17, 9)
    ids, mask = pad(prompts(3, lengths=lengths))
    batch = SequenceBatch(runner, ids.cuda(), mask.cuda(), max_length=40, prefix_cache=False)
    try:
        batch.prefill()
        last = [s.tokens[-1] for s in batch.seqs]
        rows = [[last[0]] * 5, [last[1], last[1], (last[1] + 1) % 128, last[1], last[1]], [last[2]] * 5]
        counts = [4, 4, 0]
        for seq in batch.seqs:
            seq.num_computed -= 1  # the last prompt token is recomputed as the verify step's first
        firsts = [s.num_computed for s in batch.seqs]
        batch._grow(range(3), [f + 5 for f in firsts])
        ctx = build_step(batch.seqs, [5] * 3, batch.block_size, runner.device, input_ids=torch.tensor(rows).reshape(-1),
                         block_tables=batch.block_table_dev, all_logits=True)
        runner._graphs.clear()
        runner._graphs_allowed = False  # the eager step first
        logits = runner.step(ctx).view(3, 5, -1)
        tokens, emitted = greedy_accept(logits, torch.tensor(rows, device="cuda")[:, 1:],
                                        torch.tensor(counts, device="cuda"))
        want = torch.cat([tokens, emitted[:, None]], dim=1).tolist()
        runner._graphs_allowed = True
        got = runner.greedy_verify(rows, firsts, counts, batch.block_table_dev).tolist()
        again = runner.greedy_verify(rows, firsts, counts, batch.block_table_dev).tolist()
    finally:
        batch.release()
    assert got == want == again
    assert [r[-1] for r in got] == [5, 2, 1]  # all four drafts, one, none
