"""HF's continuous-batching API on llmplug's :class:`Engine`: ``generate_batch`` and ``init_continuous_batching``.

After ``llmplug.optimize(model)``, ``model.generate_batch``, ``model.init_continuous_batching`` and
``model.continuous_batching_context_manager`` run on one :class:`Engine` per model (made on first use, stopped and
dropped by ``unoptimize``) and hand back HF's own ``GenerationOutput``. ``model.generate(...,
cache_implementation="paged")`` reaches them through stock HF generate, as it does without llmplug.

The :class:`GenerationConfig` maps to :class:`SamplingParams` as HF's continuous batching reads it (``hf_config``):
no ``max_new_tokens`` / ``max_length`` means no limit but the model's length and the KV pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
import time
import types
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from ..patches.undo import UndoLog
from ..state import current_state
from .engine import Engine
from .hf_config import REQUEST_KEYS, eos_ids, sampling_fields
from .params import SamplingParams
from .request import RequestOutput, StreamDelta

__all__ = ["ContinuousBatchingManager", "engine_of", "install"]

_HARD_STOP_ERROR = "Generation loop finished before this request completed (hard stop)"

_lock = threading.Lock()  # engine creation and the loop's user counts
_loop_users: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Engine -> [users, started by us]
_managers = itertools.count()


# ---- one engine per model, its background loop shared by every manager --------------------------------------------
def engine_of(model: torch.nn.Module) -> Engine:
    """The model's :class:`Engine`, made on first use (again after the model moved); ``unoptimize`` stops and drops
    it."""
    state = current_state(model)
    with _lock:
        if state.engine is None:
            state.engine = Engine(model)
            state.undo.record(functools.partial(_shutdown, state.engine))
    return state.engine


def _shutdown(engine: Engine) -> None:
    with _lock:
        _loop_users.pop(engine, None)
        engine.stop()


def _hold_loop(engine: Engine) -> None:
    """One more user of the engine's background loop; starts it (again, if it died on an error) when needed."""
    with _lock:
        entry = _loop_users.setdefault(engine, [0, False])
        if entry[0] == 0:
            entry[1] = not engine.is_running()  # a loop the user started is left running
        if not engine.is_running():
            engine.stop()  # forgets a loop thread that died on an error, so that start() runs a new one
            engine.start()
        entry[0] += 1


def _release_loop(engine: Engine) -> None:
    with _lock:
        entry = _loop_users.get(engine)
        if entry is None or entry[0] == 0:
            return
        entry[0] -= 1
        if entry[0] == 0 and entry[1]:
            engine.stop()


# ---- the manager -----------------------------------------------------------------------------------------------------
@dataclass
class _Track:
    """One request of a manager: its sample ids (``[parent, child#0, ...]``) and what was streamed so far."""

    request_id: str
    engine_id: str
    sample_ids: list[str]
    prompt: list[int]
    streaming: bool
    record: bool
    created: float = field(default_factory=time.perf_counter)
    tokens: list[list[int]] = field(default_factory=list)
    times: list[list[float]] = field(default_factory=list)
    cancelled: bool = False
    hard_stopped: bool = False


class ContinuousBatchingManager:
    """HF's ``ContinuousBatchingManager`` interface over the model's :class:`Engine`.

    Made by ``model.init_continuous_batching``. Requests go to the engine as they are added; ``start`` / ``stop``
    hold and release the engine's background loop (shared with the model's other managers). Finished requests, and
    every new token of ``streaming`` ones, come back as HF ``GenerationOutput`` s through :meth:`get_result`,
    iteration or :meth:`register_result_handler`. Cancelled requests produce no output, as in HF.
    """

    def __init__(self, model: torch.nn.Module, generation_config: GenerationConfig, assistant_model=None) -> None:
        self.model = model
        self.generation_config = generation_config
        self.num_return_sequences = int(generation_config.num_return_sequences or 1)
        self.warmed_up = False
        self._fields = sampling_fields(generation_config, assistant_model)
        self._engine = engine_of(model)
        self._prefix = f"hf{next(_managers)}/"  # engine ids of this manager's requests
        self._cond = threading.Condition()
        self._pending: dict[str, _Track] = {}
        self._results: deque[GenerationOutput] = deque()
        self._handlers: dict[str, tuple[Callable, asyncio.AbstractEventLoop]] = {}
        self._counter = 0
        self._running = False  # from start() until stop() has drained this manager's requests
        self._holding = False  # holds one use of the engine's loop
        self._accepting = True
        self._stopper: threading.Thread | None = None

    # ---- control flow ------------------------------------------------------------------------------------------
    def warmup(self, progress: bool = False) -> None:
        """Capture the engine's decode CUDA graphs now (skipped while its loop runs: they are captured on use)."""
        with _lock:
            if not self._engine.is_running():
                self._engine.warmup(progress=progress)
        self.warmed_up = True

    def is_running(self) -> bool:
        return self._running and self._engine.is_running()

    def start(self) -> None:
        """Start processing requests (on the engine's shared background loop)."""
        if self.is_running():
            warnings.warn("Manager thread is already running.", stacklevel=2)
            return
        if self._stopper is not None:
            self._stopper.join()
            self._stopper = None
        if self._holding:
            _release_loop(self._engine)
        _hold_loop(self._engine)
        self._holding = True
        self._accepting = True
        self._running = True

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Stop accepting requests, let the pending ones finish (or fail them with ``hard_stop``), release the loop.

        ``keep_for_next_session`` is accepted for HF compatibility: the engine always stays with the model.
        """
        if not self._running:
            warnings.warn("Manager not started.", stacklevel=2)
            return
        self._accepting = False
        if hard_stop:
            with self._cond:
                tracks = list(self._pending.values())
            for track in tracks:
                track.hard_stopped = True
                self._abort(track)
        if self._stopper is None:
            self._stopper = threading.Thread(target=self._drain_and_release, name="llmplug-hf-stop", daemon=True)
            self._stopper.start()
        if block:
            self.join(timeout=timeout)

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        """Wait (at most ``timeout`` seconds) for :meth:`stop` to finish."""
        stopper = self._stopper
        if stopper is None:
            return
        stopper.join(timeout)
        if stopper.is_alive():
            warnings.warn(f"the manager did not stop within {timeout} s; it stops once its requests finish",
                          stacklevel=2)

    def destroy(self) -> None:  # HF's: stop for good
        if self.is_running():
            self.stop(block=True)

    def _drain_and_release(self) -> None:
        with self._cond:
            while self._pending and self._engine.is_running():
                self._cond.wait(0.1)
            for track in list(self._pending.values()):  # the engine was stopped under us (unoptimize)
                self._close(track, None, "the llmplug engine stopped before this request completed")
        if self._holding:
            self._holding = False
            _release_loop(self._engine)
        with self._cond:
            self._running = False
            self._cond.notify_all()

    # ---- submission --------------------------------------------------------------------------------------------
    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False,
                    eos_token_id: int | list[int] | None = None, **logit_processor_kwargs) -> str | None:
        """Queue one prompt; returns its request id (``req_<k>`` when None), or None once the manager is stopping.

        ``logit_processor_kwargs`` may override ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
        ``repetition_penalty`` or set a ``seed`` for this request. A request the engine rejects (prompt too long,
        unknown token ids) is delivered as a ``FAILED`` output.
        """
        if not self._accepting:
            warnings.warn(f"the manager is stopping: request {request_id} dropped", stacklevel=2)
            return None
        unknown = sorted(set(logit_processor_kwargs) - set(REQUEST_KEYS))
        if unknown:
            raise ValueError(f"unknown logit_processor_kwargs {unknown}; allowed: {list(REQUEST_KEYS)}")
        if request_id is None:
            with self._cond:
                request_id, self._counter = f"req_{self._counter}", self._counter + 1
        prompt = [int(t) for t in input_ids]
        eos = self.generation_config.eos_token_id if eos_token_id is None else eos_token_id
        params = self._params(len(prompt), max_new_tokens, eos, logit_processor_kwargs)
        track = _Track(request_id, self._prefix + request_id,
                       [request_id] + [f"{request_id}__child#{i}" for i in range(params.n - 1)], prompt, streaming,
                       record_timestamps, tokens=[[] for _ in range(params.n)], times=[[] for _ in range(params.n)])
        with self._cond:
            if request_id in self._pending:
                raise ValueError(f"request_id={request_id!r} is already pending in this manager")
            self._pending[request_id] = track
        try:
            self._engine.add_request(prompt, params, request_id=track.engine_id,
                                     on_event=functools.partial(self._on_event, track), stream=streaming)
        except ValueError as error:
            with self._cond:
                self._close(track, None, f"{type(error).__name__}: {error}")
        return request_id

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **logit_processor_kwargs) -> list[str]:
        """:meth:`add_request` for each prompt, ids ``req_<k>`` in order; returns the ids."""
        with self._cond:
            first, self._counter = self._counter, self._counter + len(inputs)
        ids = [f"req_{i}" for i in range(first, first + len(inputs))]
        for request_id, input_ids in zip(ids, inputs):
            self.add_request(input_ids, request_id, max_new_tokens, streaming, record_timestamps,
                             **logit_processor_kwargs)
        return ids

    def _params(self, prompt_len: int, max_new_tokens: int | None, eos, overrides: dict) -> SamplingParams:
        config = self.generation_config
        if max_new_tokens is None:
            max_new_tokens = config.max_new_tokens
        if max_new_tokens is None:  # with no max_length either, HF's has no limit: the model's length or the KV pool
            limit = config.max_length or min(self._engine.runner.max_model_len,
                                             self._engine.blocks.num_total * self._engine.block_size)
            max_new_tokens = max(1, limit - prompt_len)
        min_new = max(config.min_new_tokens or 0, (config.min_length or 0) - prompt_len)
        fields = {**self._fields, **overrides}
        return SamplingParams(max_new_tokens=max_new_tokens, min_new_tokens=min(min_new, max_new_tokens),
                              stop_token_ids=eos_ids(eos), ignore_eos=True, **fields)

    def cancel_request(self, request_id: str) -> None:
        """Stop a request; it produces no output (as in HF). Unknown or finished ids are ignored."""
        with self._cond:
            track = self._pending.get(request_id)
        if track is not None:
            track.cancelled = True
            self._abort(track)

    def _abort(self, track: _Track) -> None:
        try:
            self._engine.abort(track.engine_id)
        except KeyError:  # finished meanwhile: its output is (being) delivered
            pass

    # ---- delivery (engine thread) --------------------------------------------------------------------------------
    def _on_event(self, track: _Track, item: StreamDelta | RequestOutput) -> None:
        if isinstance(item, RequestOutput):
            with self._cond:
                self._close(track, item, item.error)
            return
        if not track.streaming or item.finished:  # the last tokens come with the final output
            return
        tokens, times = track.tokens[item.index], track.times[item.index]
        with self._cond:
            for token in item.token_ids:
                tokens.append(token)
                if track.record:
                    times.append(time.perf_counter())
                self._put(GenerationOutput(
                    request_id=track.sample_ids[item.index], prompt_ids=list(track.prompt),
                    generated_tokens=list(tokens), status=RequestStatus.DECODING, created_time=track.created,
                    lifespan=(track.created, -1), timestamps=list(times) if track.record else None))

    def _close(self, track: _Track, output: RequestOutput | None, error: str | None) -> None:
        """Deliver the final outputs of ``track`` (children first, then the parent, as HF orders them)."""
        if self._pending.pop(track.request_id, None) is None:
            return
        self._cond.notify_all()
        samples = {c.index: c for c in output.outputs} if output is not None else {}
        if any(c.finish_reason == "abort" for c in samples.values()) and error is None:
            if track.cancelled and not track.hard_stopped:
                return
            error = _HARD_STOP_ERROR if track.hard_stopped else "aborted"
        finish = output.finish_time if output is not None and output.finish_time is not None else time.perf_counter()
        for index in list(range(1, len(track.sample_ids))) + [0]:
            sample = samples.get(index)
            reason = error
            if reason is None and (sample is None or sample.finish_reason == "error"):
                reason = "the engine returned no output for this sample"
            times = None
            if track.record:  # times already streamed stay as they were sent
                streamed = track.times[index]
                times = streamed + (list(sample.token_times[len(streamed):]) if sample else [])
            self._put(GenerationOutput(
                request_id=track.sample_ids[index], prompt_ids=list(track.prompt),
                generated_tokens=list(sample.token_ids) if sample else [], logprobs=[], error=reason,
                status=RequestStatus.FAILED if reason else RequestStatus.FINISHED, created_time=track.created,
                lifespan=(track.created, finish), timestamps=times))

    def _put(self, output: GenerationOutput) -> None:
        """Route ``output`` to its registered handler or the results queue (``self._cond`` held)."""
        entry = self._handlers.get(output.request_id)
        if entry is not None:
            entry[1].call_soon_threadsafe(entry[0], output)
        else:
            self._results.append(output)
        self._cond.notify_all()

    # ---- retrieval ---------------------------------------------------------------------------------------------
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of ``request_id`` if given); None after ``timeout`` s or when nothing more can come."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                for i, result in enumerate(self._results):
                    if request_id is None or result.request_id == request_id:
                        del self._results[i]
                        return result
                if not self.is_running():
                    return None
                left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                if left <= 0:
                    return None
                self._cond.wait(left)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Outputs as they come, while the manager runs."""
        while self.is_running():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Outputs of one request (every token when streaming) until its final one."""
        while self.is_running():
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], None]) -> None:
        """Call ``callback`` on the running asyncio loop with each output of ``request_id`` (removed when finished)."""
        loop = asyncio.get_running_loop()

        def _auto_cleanup(result: GenerationOutput) -> None:
            callback(result)
            if result.is_finished():
                with self._cond:
                    self._handlers.pop(request_id, None)

        with self._cond:
            self._handlers[request_id] = (_auto_cleanup, loop)


# ---- the model's methods ---------------------------------------------------------------------------------------------
def init_continuous_batching(model, generation_config: GenerationConfig | None = None,
                             continuous_batching_config=None, workload_hints=None,
                             assistant_model=None) -> ContinuousBatchingManager:
    """HF's ``init_continuous_batching`` on llmplug; ``continuous_batching_config`` and ``workload_hints`` are ignored
    (the engine is sized by ``llmplug.optimize``). llmplug's own ``assistant_model``: the manager's requests speculate
    with that draft model (``generation_config.num_assistant_tokens`` drafts a step)."""
    config = generation_config if generation_config is not None else model.generation_config
    if config is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    return ContinuousBatchingManager(model, config, assistant_model)


@contextlib.contextmanager
def continuous_batching_context_manager(model, generation_config: GenerationConfig | None = None, block: bool = True,
                                        timeout: float | None = None, continuous_batching_config=None,
                                        persistent_manager: bool = False, warmup: bool = True,
                                        workload_hints=None) -> Iterator[ContinuousBatchingManager]:
    """A started manager, stopped on exit (``block`` / ``timeout`` as in :meth:`ContinuousBatchingManager.stop`)."""
    manager = init_continuous_batching(model, generation_config)
    if warmup:
        manager.warmup()
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=block, timeout=timeout)


def generate_batch(model, inputs: list[list[int]], generation_config: GenerationConfig | None = None,
                   continuous_batching_config=None, record_timestamps: bool = False, progress_bar: bool = False,
                   persistent_manager: bool = False, warmup: bool = True, **kwargs) -> dict[str, GenerationOutput]:
    """HF's ``generate_batch`` on llmplug's engine.

    Returns:
        ``{request_id: GenerationOutput}`` in input order (``req_0``, ``req_1``, ...), each request's
        ``num_return_sequences - 1`` children (``req_<k>__child#<i>``) right before it. ``max_new_tokens`` and
        ``assistant_model`` (llmplug's: a draft model every request speculates with) are the keywords read from
        ``kwargs``; other keywords (HF-only knobs) are ignored, as HF does.
    """
    if not inputs:
        return {}
    config = generation_config if generation_config is not None else model.generation_config
    n = int(config.num_return_sequences or 1)
    total = len(inputs) * n
    manager = init_continuous_batching(model, generation_config, assistant_model=kwargs.get("assistant_model"))
    results: dict[str, GenerationOutput] = {}
    ids: list[str] = []
    done = False
    if warmup:
        manager.warmup(progress=progress_bar)
    manager.start()
    try:
        with tqdm(total=total, disable=not progress_bar, desc=f"Solving {total} requests", unit="request") as bar:
            ids = manager.add_requests(inputs, max_new_tokens=kwargs.get("max_new_tokens"),
                                       record_timestamps=record_timestamps)
            while len(results) < total:
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                    bar.update(1)
                elif result is None and not manager.is_running():
                    warnings.warn("the llmplug engine stopped before every request finished", stacklevel=2)
                    break
        done = True
    finally:
        manager.stop(block=True, timeout=5, hard_stop=not done)
    ordered = {}
    for request_id in ids:
        for sample_id in [f"{request_id}__child#{i}" for i in range(n - 1)] + [request_id]:
            if sample_id in results:
                ordered[sample_id] = results[sample_id]
    failed = [k for k, v in ordered.items() if v.error is not None]
    if failed:
        warnings.warn(f"Requests {failed} failed during generation: {ordered[failed[0]].error}", stacklevel=2)
    return ordered


def install(model: torch.nn.Module, log: UndoLog) -> None:
    """Point the model's continuous-batching methods at llmplug (recorded in ``log``)."""
    for name, fn in (("generate_batch", generate_batch), ("init_continuous_batching", init_continuous_batching),
                     ("continuous_batching_context_manager", continuous_batching_context_manager)):
        log.set_attr(model, name, types.MethodType(fn, model))
