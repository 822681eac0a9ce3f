"""The rejection sampler is exact: every emitted token follows the target's distribution (chi-square over 2e5 draws
per case, several temperatures and top-p), and a plausibly biased variant fails the same test."""

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopPLogitsWarper

from llmplug.spec import rejection
from llmplug.spec.rejection import greedy_accept, rejection_sample

V, K, DRAWS = 12, 2, 200_000


def _target(temperature: float, top_p: float, g: torch.Generator) -> torch.Tensor:
    """``(K + 1, V)`` distributions after HF's own temperature and top-p warpers, different at each position."""
    logits = torch.randn(K + 1, V, generator=g) * 2
    scores = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits))
    return scores.softmax(-1)


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of ``counts`` to ``probs`` over the support (df = support - 1)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    n = counts.sum()
    expected = probs[support].double() * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    if df == 0:  # a one-token support: only the assertion above can fail
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _emitted_fit(sampler, p: torch.Tensor, with_q: bool, seed: int) -> list[float]:
    """p-values of the token emitted at each position (among the draws that reached it) against ``p``."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(K, V, generator=g) * 1.5).softmax(-1)
    drafts = torch.stack([torch.multinomial(q[i], DRAWS, replacement=True, generator=g) for i in range(K)], 1)
    torch.manual_seed(seed)
    tokens, emitted = sampler(p.expand(DRAWS, -1, -1), drafts, torch.full((DRAWS,), K),
                              q.expand(DRAWS, -1, -1) if with_q else None)
    out = []
    for i in range(K + 1):
        reached = emitted > i
        assert (tokens[reached, i] >= 0).all() and (tokens[~reached, i] == -1).all()
        out.append(_p_value(torch.bincount(tokens[reached, i], minlength=V), p[i]))
    return out


def _resample_rejected(target_probs, draft_tokens, num_drafts, draft_probs):
    """A plausible bug: after a rejection, draw from the target's distribution itself instead of the residual."""
    rows, k = draft_tokens.shape
    p_x = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)
    ok = torch.rand(rows, k) * q_x < p_x
    kept = torch.where(~ok, torch.arange(k)[None], k).min(1).values
    last = rejection._draw(target_probs.gather(1, kept[:, None, None].expand(-1, 1, V)).squeeze(1), None)
    tokens = torch.where(torch.arange(k + 1)[None] < kept[:, None], torch.cat([draft_tokens, draft_tokens[:, :1]], 1),
                         -1)
    tokens.scatter_(1, kept[:, None], last[:, None])
    return tokens, kept + 1


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 1.0), (1.3, 0.8), (0.8, 0.5)])
@pytest.mark.parametrize("with_q", [True, False])  # a draft model's q, or a deterministic proposer (one-hot q)
def test_emitted_tokens_follow_the_target(temperature, top_p, with_q):
    p = _target(temperature, top_p, torch.Generator().manual_seed(1))
    assert min(_emitted_fit(rejection_sample, p, with_q, seed=2)) > 1e-3


@pytest.mark.parametrize("with_q", [True, False])
def test_a_biased_sampler_fails(with_q):
    p = _target(1.0, 1.0, torch.Generator().manual_seed(1))
    assert min(_emitted_fit(_resample_rejected, p, with_q, seed=2)) < 1e-6


def test_seeded_rows_repeat_and_shapes():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(5, 4, V, generator=g).softmax(-1)
    drafts = torch.randint(0, V, (5, 3), generator=g)
    n = torch.tensor([0, 1, 2, 3, 3])
    runs = [rejection_sample(p, drafts, n, None, [torch.Generator().manual_seed(b) for b in range(5)])
            for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    tokens, emitted = runs[0]
    assert (emitted >= 1).all() and (emitted <= n + 1).all()
    for b in range(5):
        assert torch.equal(tokens[b, :emitted[b] - 1], drafts[b, :emitted[b] - 1])
    with pytest.raises(ValueError, match="target_probs must be"):
        rejection_sample(p[:, :3], drafts, n)


def test_greedy_accept_equals_greedy_decoding():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, K + 2, V, generator=g)
    best = logits.argmax(-1)
    drafts = best[:, :K + 1].clone()
    drafts[1, 0] = (best[1, 0] + 1) % V  # first draft wrong
    drafts[2, 2] = (best[2, 2] + 1) % V  # third draft wrong
    n = torch.tensor([3, 3, 3, 2, 0, 1])
    tokens, emitted = greedy_accept(logits, drafts, n)
    assert emitted.tolist() == [4, 1, 3, 3, 1, 2]
    for b in range(6):
        assert torch.equal(tokens[b, :emitted[b]], best[b, :emitted[b]])
        assert (tokens[b, emitted[b]:] == -1).all()
