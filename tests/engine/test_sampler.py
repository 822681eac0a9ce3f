"""The batched sampler against per-row references: HF's logits processors and warpers, plain argmax, counts."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from llmplug import SamplingParams
from llmplug.engine.request import Request
from llmplug.engine.sampler import _penalize, sample

V = 64


def seq(prompt=(5, 6, 7), output=(), stop_ids=(), **params):
    """A sequence of a request with ``params`` that has generated ``output`` so far."""
    request = Request("r", list(prompt), SamplingParams(**params), stop_ids=frozenset(stop_ids))
    s = request.seqs[0]
    s.tokens += list(output)
    return s


def logits(rows: int, vocab: int = V, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def hf_allowed(row: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> set[int]:
    """Tokens HF's warper chain (temperature, top-k, top-p, min-p, in generate's order) leaves finite."""
    scores = row[None].clone()
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    for w in warpers:
        scores = w(None, scores)
    return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    x = logits(6)
    seqs = [seq(temperature=0.0), seq(do_sample=False), seq(temperature=0.9, seed=1), seq(temperature=0.0),
            seq(temperature=1.0, top_k=5), seq(temperature=0.0, min_new_tokens=3)]
    before = x.clone()
    out = sample(x, seqs)
    assert out.dtype == torch.long and out.shape == (6,)
    for i in (0, 1, 3, 5):
        assert out[i] == x[i].argmax()
    assert torch.equal(x, before), "the sampler must not write into the runner's logits"
    assert torch.equal(sample(x[[0, 3]], [seqs[0], seqs[3]]), x[[0, 3]].argmax(-1))  # the all-greedy fast path


def test_repetition_penalty_matches_hf():
    x = logits(5)
    x[:, :8] = x[:, :8].abs() * torch.tensor([1, -1, 1, -1, 1, -1, 1, -1.0])  # both signs among penalized tokens
    histories = [([1, 2, 3], [4, 4, 1]), ([0, 5, 7, 7], [6]), ([2], []), ([3, 3, 3], [2, 5, 0, 1]), ([9, 63], [7])]
    penalties = [1.3, 0.7, 2.0, 1.0, 1.1]
    seqs = [seq(p, o, temperature=0.0, repetition_penalty=r) for (p, o), r in zip(histories, penalties)]
    got = x.clone()
    _penalize(got, seqs)
    for i, ((p, o), r) in enumerate(zip(histories, penalties)):
        want = RepetitionPenaltyLogitsProcessor(r)(torch.tensor([p + o]), x[i:i + 1].clone())[0]
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)
    assert torch.equal(sample(x, seqs), got.argmax(-1))


def test_frequency_and_presence_penalties_count_output_tokens_only():
    x = logits(4)
    cases = [([1, 2], [3, 3, 3, 4], 0.5, 0.0), ([3, 3], [3, 9], 0.0, 1.5), ([5], [5, 5, 8, 60], 0.8, -0.4),
             ([2, 2, 2], [], 1.0, 1.0)]
    seqs = [seq(p, o, temperature=0.0, frequency_penalty=f, presence_penalty=q) for p, o, f, q in cases]
    got = x.clone()
    _penalize(got, seqs)
    for i, (_, out, f, q) in enumerate(cases):
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V).float()
        torch.testing.assert_close(got[i], x[i] - f * counts - q * (counts > 0).float())
    assert torch.equal(sample(x, seqs), got.argmax(-1))


def test_min_new_tokens_masks_stop_ids_until_reached():
    x = logits(1).repeat(4, 1)
    top3 = x[0].topk(3).indices.tolist()
    stop = (top3[0], top3[1])
    seqs = [seq(output=[9] * k, stop_ids=stop, temperature=0.0, min_new_tokens=2) for k in (0, 1, 2, 3)]
    assert sample(x, seqs).tolist() == [top3[2], top3[2], top3[0], top3[0]]
    sampled = [seq(output=[], stop_ids=stop, temperature=1.0, seed=s, min_new_tokens=1) for s in range(200)]
    assert not set(sample(x[:1].repeat(200, 1) * 0, sampled).tolist()) & set(stop)  # flat: any but the stop ids


@pytest.mark.parametrize("kw", [
    dict(top_k=5), dict(top_p=0.8), dict(min_p=0.2), dict(temperature=0.6, top_k=10, top_p=0.9),
    dict(temperature=1.5, top_p=0.5, min_p=0.05), dict(top_k=20, min_p=0.3), dict(top_k=1), dict(top_p=0.01),
])
def test_filters_only_let_allowed_tokens_through(kw):
    x = logits(3, scale=2.0, seed=4)
    for row in x:
        allowed = hf_allowed(row, **kw)
        seqs = [seq(seed=s, **kw) for s in range(400)] + [seq(**kw) for _ in range(100)]
        drawn = set(sample(row[None].repeat(500, 1), seqs).tolist())
        assert drawn <= allowed, f"drew {sorted(drawn - allowed)} outside {sorted(allowed)}"
        if len(allowed) > 1:
            assert len(drawn) > 1


def test_seeded_rows_do_not_depend_on_the_batch():
    target = logits(1, seed=2)[0]

    def draws(batch, where, steps=6):
        """Tokens of ``batch[where]`` (its row reads ``target``, the other rows fresh logits) over ``steps`` steps."""
        out = []
        for step in range(steps):
            rows = logits(len(batch), seed=100 + step)
            rows[where] = target
            out.append(int(sample(rows, batch)[where]))
            batch[where].tokens.append(out[-1])
        return out

    alone = draws([seq(seed=7, top_k=30)], 0)
    assert len(set(alone)) > 1
    assert draws([seq(temperature=0.7), seq(seed=8), seq(seed=7, top_k=30), seq(temperature=0.0)], 2) == alone
    assert draws([seq(seed=7, top_k=30), seq(seed=7), seq(top_p=0.5)], 0) == alone
    assert draws([seq(seed=8, top_k=30)], 0) != alone


@pytest.mark.parametrize("kw, expected", [
    (dict(), [0.1, 0.2, 0.3, 0.15, 0.25]),
    (dict(temperature=0.5), [0.01, 0.04, 0.09, 0.0225, 0.0625]),
    (dict(top_k=3), [0, 0.2, 0.3, 0, 0.25]),
    (dict(top_p=0.7), [0, 0.2, 0.3, 0, 0.25]),
    (dict(min_p=0.7), [0, 0, 0.3, 0, 0.25]),
])
def test_sampled_distribution(kw, expected):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    expected = torch.tensor(expected) / sum(expected)
    n = 20000
    s = seq(**kw)
    torch.manual_seed(0)
    counts = torch.bincount(sample(probs.log()[None].repeat(n, 1), [s] * n), minlength=5).float()
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    chi2 = ((counts[keep] - n * expected[keep]) ** 2 / (n * expected[keep])).sum()
    assert chi2 < 20.0, (counts / n).tolist()  # chi-square, 4 dof: p < 0.001 above 18.5
