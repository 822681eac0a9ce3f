"""HF's per-step stop bookkeeping, replayed on the host over tokens the device chose a ring of steps earlier.

``generate``'s graph loop lets the device pick a ring of tokens without the host (CUDA graphs). Stopping criteria
are functions of the tokens so far, so evaluating them afterwards, step by step and in order, and dropping the tokens
past the stop gives exactly HF's output, while the device already runs the next ring. That is how a user's own
criteria (an evaluation harness's stop sequences, stop strings) keep the graph loop's speed.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList


def host_criteria(stopping_criteria) -> StoppingCriteriaList:
    """The criteria :class:`LateStops` must call: all but HF's max-length and eos ones (evaluated from the tokens)."""
    return StoppingCriteriaList(c for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria,
                                                                                   EosTokenCriteria)))


class LateStops:
    """What HF's ``_sample`` does after each step, applied to a ring of steps at a time.

    After step ``s`` HF's loop makes finished rows emit ``pad`` (when an eos criterion is present), appends the
    tokens, sets ``unfinished &= ~criteria(input_ids)``, and ends once no row is unfinished or ``max_length`` is
    reached. :meth:`feed` does the same over a ring's tokens; the tokens it keeps are :attr:`tokens`.

    Criteria see ``input_ids`` on the model's device, as in HF. On CUDA they run on a side stream, so reading their
    result waits for them alone, not for the ring the device is running meanwhile.

    Args:
        criteria: the criteria to call (:func:`host_criteria`); max-length and eos are applied here.
        input_ids: ``(B, L)`` the sequences so far, on the model's device.
        unfinished: ``(B,)`` bool, rows still unfinished after the last step.
        eos: ``(E,)`` int64 end-of-sequence ids (may be empty).
        pad: the id finished rows emit when ``has_eos``.
        has_eos: an eos criterion is present (HF pads finished rows only then).
        max_length: the length at which generation ends.
    """

    def __init__(self, criteria: StoppingCriteriaList, input_ids: torch.Tensor, unfinished: torch.Tensor,
                 eos: torch.Tensor, pad: int, has_eos: bool, max_length: int) -> None:
        self.criteria = criteria
        self.unfinished = unfinished.cpu()
        self.eos = eos.cpu()
        self.pad, self.has_eos, self.max_length = pad, has_eos, max_length
        self.length = input_ids.shape[1]
        self.tokens: list[torch.Tensor] = []  # kept (B, n) host chunks
        self.done = self.length >= max_length or not self.unfinished.any()
        self._host_finished = False  # a criterion finished a row the device still thinks unfinished
        device = input_ids.device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" and criteria else None
        self._ids = None
        if criteria:  # the sequences as the criteria see them: (B, max_length) on the device, filled as steps arrive
            with self._on_stream():
                if self._stream is not None:
                    self._stream.wait_stream(torch.cuda.current_stream(device))
                self._ids = torch.empty((input_ids.shape[0], max_length), dtype=input_ids.dtype, device=device)
                self._ids[:, :self.length].copy_(input_ids)

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def feed(self, chunk: torch.Tensor) -> bool:
        """Apply the steps of ``chunk`` ``(B, n)`` int64 (host; the tokens the device chose, modified in place into
        the tokens HF keeps) in order; True once generation has ended (the steps after the last kept one are
        dropped)."""
        if self.done:
            return True
        chunk = chunk[:, :self.max_length - self.length]
        n = chunk.shape[1]
        if self.has_eos:
            chunk[~self.unfinished] = self.pad
        start = self.length
        with self._on_stream():
            if self._ids is not None:
                self._ids[:, start:start + n].copy_(chunk.pin_memory() if self._stream is not None else chunk,
                                                    non_blocking=True)
            for i in range(n):
                self.length += 1
                before = self.unfinished.clone()
                self.unfinished &= ~torch.isin(chunk[:, i], self.eos)
                if self.criteria:
                    by_criteria = self.criteria(self._ids[:, :self.length], None).cpu()
                    self._host_finished |= bool((self.unfinished & by_criteria).any())
                    self.unfinished &= ~by_criteria
                ended = before & ~self.unfinished
                if self.has_eos and ended.any() and i + 1 < n:  # their later tokens are pad
                    chunk[ended, i + 1:] = self.pad
                    if self._ids is not None:
                        self._ids[ended.to(self._ids.device), start + i + 1:start + n] = self.pad
                if self.length >= self.max_length or not self.unfinished.any():
                    self.tokens.append(chunk[:, :i + 1])
                    self.done = True
                    return True
        self.tokens.append(chunk)
        return False

    def device_flags(self) -> torch.Tensor:
        """``(B,)`` bool, the device's ``unfinished`` flags (rows it feeds pad where they are False): HF pads finished
        rows only with an eos criterion; without one every row keeps its tokens."""
        return self.unfinished.clone() if self.has_eos else torch.ones_like(self.unfinished)

    def push_finished(self, unfinished: torch.Tensor) -> None:
        """Clear the device's ``unfinished (B,)`` flags of rows a criterion finished, so it feeds them pad as HF does
        (only with an eos criterion: without one HF keeps their tokens)."""
        if self.has_eos and self._host_finished:
            flags = self.unfinished.pin_memory() if unfinished.is_cuda else self.unfinished
            unfinished.logical_and_(flags.to(unfinished.device, non_blocking=True))
            self._host_finished = False

    def new_tokens(self) -> torch.Tensor:
        """``(B, n)`` every kept token, on the host."""
        return torch.cat(self.tokens, dim=1)
