"""LateStops (HF's stop bookkeeping applied a ring of steps late) against HF's step-by-step loop."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from llmplug.engine.late_stops import LateStops


class TailStop(StoppingCriteria):
    """A harness-style stateful criterion (like lm-eval's ``MultiTokenEOSCriteria``): a row is done once its last
    two tokens are ``stop``, and it stays done; every call is recorded."""

    def __init__(self, stop: tuple[int, int], prompt_len: int):
        self.stop, self.prompt_len, self.calls, self.done = list(stop), prompt_len, [], None

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append(input_ids.clone())
        if self.done is None:
            self.done = [False] * input_ids.shape[0]
        for i, row in enumerate(input_ids[:, self.prompt_len:].tolist()):
            self.done[i] = self.done[i] or row[-2:] == self.stop
        return torch.tensor(self.done)


def hf_loop(raw, prompt, criterion, eos, pad, has_eos, max_length):
    """HF ``_sample``'s bookkeeping over the device's raw choices ``raw (B, N)``: the kept new tokens."""
    ids, unfinished = prompt.clone(), torch.ones(prompt.shape[0], dtype=torch.bool)
    for s in range(raw.shape[1]):
        tok = torch.where(unfinished, raw[:, s], pad) if has_eos else raw[:, s]
        ids = torch.cat([ids, tok[:, None]], 1)
        done = torch.isin(tok, eos)
        if criterion is not None:
            done = done | StoppingCriteriaList([criterion])(ids, None)
        unfinished &= ~done
        if ids.shape[1] >= max_length or not unfinished.any():
            break
    return ids[:, prompt.shape[1]:]


@pytest.mark.parametrize("ring", [1, 3, 16])
@pytest.mark.parametrize("has_eos", [True, False])
@pytest.mark.parametrize("with_criterion", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_late_stops_equal_hf_loop(ring, has_eos, with_criterion, seed):
    g = torch.Generator().manual_seed(seed)
    batch, plen, steps = 4, 3, 40
    prompt = torch.randint(3, 9, (batch, plen), generator=g)
    raw = torch.randint(3, 9, (batch, steps), generator=g)  # small vocabulary: stops happen at various steps
    eos = torch.tensor([4]) if has_eos else torch.empty(0, dtype=torch.long)
    max_length = plen + steps - 5
    make = (lambda: TailStop((5, 6), plen)) if with_criterion else (lambda: None)
    want_crit, got_crit = make(), make()
    want = hf_loop(raw, prompt, want_crit, eos, 0, has_eos, max_length)
    criteria = StoppingCriteriaList([got_crit] if got_crit is not None else [])
    stops = LateStops(criteria, prompt, torch.ones(batch, dtype=torch.bool), eos, 0, has_eos, max_length)
    for start in range(0, steps, ring):
        if stops.feed(raw[:, start:start + ring].clone()):
            break
    assert torch.equal(stops.new_tokens(), want)
    if with_criterion:  # the criterion saw exactly what HF's loop showed it, call for call
        assert len(got_crit.calls) == len(want_crit.calls)
        assert all(torch.equal(a, b) for a, b in zip(got_crit.calls, want_crit.calls))


def test_rows_finished_by_a_criterion_are_pushed_to_the_device_only_with_eos():
    prompt = torch.tensor([[3, 3], [3, 3]])
    for has_eos in (True, False):
        stops = LateStops(StoppingCriteriaList([TailStop((5, 6), 2)]), prompt, torch.ones(2, dtype=torch.bool),
                          torch.tensor([4]), 0, has_eos, 20)
        assert not stops.feed(torch.tensor([[5, 6, 7], [7, 7, 7]]))
        device_flags = torch.ones(2, dtype=torch.bool)
        stops.push_finished(device_flags)
        assert device_flags.tolist() == ([False, True] if has_eos else [True, True])
        assert stops.device_flags().tolist() == device_flags.tolist()  # a graph loop entered now pads the same rows
        assert stops.new_tokens()[0].tolist() == ([5, 6, 0] if has_eos else [5, 6, 7])
