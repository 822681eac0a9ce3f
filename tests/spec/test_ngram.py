"""Prompt lookup proposals."""

import pytest
import torch

from llmplug.spec.ngram import propose_ngram


def t(*ids):
    return torch.tensor(ids)


def test_latest_match_of_the_longest_tail():
    seq = t(1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3)
    assert propose_ngram(seq, 3).tolist() == [5, 6, 7]  # tail (2, 3): latest earlier match is at 5
    assert propose_ngram(seq, 3, max_ngram=1).tolist() == [5, 6, 7]  # tail (3,): same place
    seq = t(7, 8, 1, 2, 3, 4, 1, 9, 2, 3)
    assert propose_ngram(seq, 2, max_ngram=3).tolist() == [4, 1]  # (9, 2, 3) nowhere, (2, 3) at 3


def test_proposals_stop_at_the_end_and_may_overlap_the_tail():
    seq = t(5, 5, 5, 5)
    assert propose_ngram(seq, 4, max_ngram=2).tolist() == [5]  # match at 1..2, successor 3 only
    assert propose_ngram(t(1, 2, 3), 4).numel() == 0
    assert propose_ngram(t(4), 4).numel() == 0


def test_min_ngram_and_errors():
    seq = t(1, 2, 3, 8, 2, 4, 3)
    assert propose_ngram(seq, 2, max_ngram=2, min_ngram=1).tolist() == [8, 2]
    assert propose_ngram(seq, 2, max_ngram=2, min_ngram=2).numel() == 0
    for kw in (dict(k=0), dict(k=2, min_ngram=0), dict(k=2, max_ngram=1, min_ngram=2)):
        with pytest.raises(ValueError, match="need k >= 1"):
            propose_ngram(seq, **kw)
