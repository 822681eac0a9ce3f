"""The Engine under tensor parallelism: every rank runs the same steps.

Each step, rank 0 sends the requests and aborts its callers gave it since the last step (JSON bytes over the group's
host-side gloo twin, so no rank waits for its GPU to send or receive them: prompt ids, sampling settings, request
ids). Ranks driven by :meth:`Engine.follow` take the same ones (requests enter on rank 0 alone, as a server's would);
ranks whose callers make the same engine calls themselves (a ``torchrun`` script running ``generate`` /
``generate_batch`` everywhere) wait for their own copy of each. So every rank schedules the same batches. Sampled
tokens are rank 0's everywhere (the engine broadcasts them on the device). Rank 0 ends the others' ``follow`` with
:meth:`Engine.release_followers`.
"""

from __future__ import annotations

import dataclasses
import json
import time

from ..parallel.group import TPGroup
from .params import SamplingParams, SpeculativeConfig


def check_params(params: SamplingParams) -> None:
    """Raise unless ``params`` can travel between ranks (a request's own draft model or head cannot)."""
    spec = params.speculative
    if spec is not None and spec.method != "ngram":
        raise ValueError(f"under tensor parallelism a request's own speculative method must be 'ngram' (its settings "
                         f"travel between ranks), got {spec.method!r}: set it in EngineConfig(speculative=...) instead")


def _params_dict(params: SamplingParams) -> dict:
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "speculative"}
    spec = params.speculative
    if spec is not None:
        out["speculative"] = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
                              if f.name not in ("draft_model", "head")}
    return out


def _params_of(data: dict) -> SamplingParams:
    spec = data.pop("speculative", None)
    for key in ("stop_token_ids", "stop"):
        data[key] = tuple(data[key])
    return SamplingParams(**data, speculative=SpeculativeConfig(**spec) if spec else None)


class RankZeroRequests:
    """Rank 0's inbox and aborts, shared with the other ranks once a step (see the module docstring)."""

    def __init__(self, engine, tp: TPGroup) -> None:
        self.engine, self.tp = engine, tp
        self.stop = False  # rank 0: tell the followers to return; elsewhere: rank 0 said so
        self.following = False  # this rank takes rank 0's requests (Engine.follow) rather than its callers' own
        self.outputs: list = []  # a following rank's finished requests, for follow() to return
        self.wait_s = 60.0  # how long a rank waits for its own caller to give it a request rank 0 took

    def exchange(self) -> tuple[list, list[str]]:
        """The requests and aborts this step takes, rank 0's on every rank (taken out of the engine's inbox): rank 0
        sends its own; a following rank adds them; a rank whose callers make the same calls waits (up to
        ``wait_s``) for each announced request to reach its own inbox."""
        engine = self.engine
        if self.tp.rank == 0:
            with engine._lock:
                inbox, engine._inbox = engine._inbox, []
                aborts, engine._aborts = engine._aborts, []
            message = {"requests": [{"id": r.request_id, "prompt": r.seqs[0].tokens[:r.seqs[0].prompt_len],
                                     "params": _params_dict(r.params)} for r in inbox],
                       "aborts": aborts, "stop": self.stop}
            self.tp.broadcast_bytes(json.dumps(message).encode())
            return inbox, aborts
        message = json.loads(self.tp.broadcast_bytes(None))
        self.stop = message["stop"]
        ids, aborts = [r["id"] for r in message["requests"]], message["aborts"]
        if self.following:
            for r in message["requests"]:
                engine.add_request(r["prompt"], _params_of(r["params"]), request_id=r["id"],
                                   on_event=self.outputs.append, stream=False)
        deadline = time.monotonic() + self.wait_s
        while True:
            with engine._lock:
                mine = {r.request_id: r for r in engine._inbox}
                if all(i in mine for i in ids):
                    taken, aborted = set(ids), set(aborts)
                    engine._inbox = [r for r in engine._inbox if r.request_id not in taken]
                    engine._aborts = [a for a in engine._aborts if a not in aborted]
                    return [mine[i] for i in ids], aborts
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 took requests {ids} that rank {self.tp.rank} was not given within "
                                   f"{self.wait_s:.0f} s: under tensor parallelism every rank makes the same engine "
                                   "calls, or the ranks other than 0 run engine.follow()")
            time.sleep(0.001)


class RankZeroMixin:
    """``follow`` and ``release_followers`` of :class:`~llmplug.Engine` (its ``tp_requests``: :class:`RankZeroRequests`
    under tensor parallelism, else None)."""

    def follow(self) -> list:
        """Under tensor parallelism, on every rank but 0: run rank 0's steps (its requests, aborts and sampled tokens)
        until rank 0 calls :meth:`release_followers` -> the :class:`~llmplug.RequestOutput` of every request that
        finished meanwhile (rank 0's outputs, in finish order). (Or every rank makes the same engine calls itself;
        the engine checks each step that they did.)"""
        tp = self.tp_requests
        if tp is None or tp.tp.rank == 0:
            raise RuntimeError("follow() is for the ranks other than 0 of a tensor-parallel engine")
        if self.has_unfinished_requests():
            raise RuntimeError(f"rank {tp.tp.rank} has requests of its own: a following rank takes rank 0's only")
        tp.stop, tp.following, tp.outputs = False, True, []
        try:
            while not tp.stop:
                self.step()
        finally:
            tp.following = False
        return tp.outputs

    def release_followers(self) -> None:
        """On rank 0 of a tensor-parallel engine: one more step, which ends the other ranks' :meth:`follow` (stop the
        background loop first)."""
        if self.tp_requests is None or self.tp_requests.tp.rank != 0:
            raise RuntimeError("release_followers() is for rank 0 of a tensor-parallel engine")
        self.tp_requests.stop = True
        try:
            self.step()
        finally:
            self.tp_requests.stop = False
