"""The ways to drive an :class:`~llmplug.engine.engine.Engine`: whole batches, streams, a background loop, asyncio.

:class:`ServingMixin` holds them so ``engine.py`` keeps the step itself; it relies on the engine's ``add_request``,
``abort``, ``step``, ``has_unfinished_requests`` and its scheduler, lock, wake event and pending step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator

import torch
from tqdm.auto import tqdm

from .params import SamplingParams
from .request import RequestOutput, StreamDelta

Prompt = str | list[int] | torch.Tensor


class ServingMixin:
    """``generate``, ``stream``, ``start`` / ``stop`` and ``agenerate`` / ``astream`` of :class:`Engine`."""

    # ---- batch APIs ------------------------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = True) -> list[RequestOutput]:
        """Run ``prompts`` to completion (with a progress bar); outputs in prompt order.

        A single prompt (text, a flat list of ids or a 1-D tensor of ids) is one request. ``params`` is one for all or
        one per prompt.

        Raises:
            ValueError: a tensor of prompts that is not 1-D (a padded ``(B, T)`` batch would generate from its padding;
                pass its rows without the padding, as a list).
        """
        if isinstance(prompts, torch.Tensor) and prompts.dim() != 1:
            raise ValueError(f"prompts as a tensor must be one 1-D prompt, got shape {tuple(prompts.shape)}; pass a "
                             "list of prompts without their padding")
        single = isinstance(prompts, (str, torch.Tensor)) or (len(prompts) > 0 and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        done: dict[str, RequestOutput] = {}
        event = threading.Event()
        bar = tqdm(total=len(prompts), desc="llmplug generate", unit="req", disable=not progress)

        def collect(item):
            if isinstance(item, RequestOutput):
                done[item.request_id] = item
                bar.update(1)
                if len(done) == len(prompts):
                    event.set()

        ids: list[str] = []
        with bar:  # closed however this ends, a rejected request included
            try:
                for prompt, p in zip(prompts, params):
                    ids.append(self.add_request(prompt, p, on_event=collect, stream=False))
            except Exception:
                for rid in ids:
                    self.abort(rid)
                raise
            if self._thread is None:
                while len(done) < len(ids):
                    self.step()
            else:
                event.wait()
        return [done[rid] for rid in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamDelta]:
        """Yield :class:`StreamDelta` s of one request as its tokens arrive (drives steps itself without a loop)."""
        events: queue.Queue = queue.Queue()
        rid = self.add_request(prompt, params, request_id, on_event=events.put)
        closed = False
        try:
            while not closed:
                if self._thread is None:
                    while events.empty():
                        self.step()
                item = events.get()
                self._raise_loop_error()
                if isinstance(item, RequestOutput):
                    closed = True
                else:
                    yield item
        finally:  # the caller stopped iterating early: stop the request
            if not closed:
                try:
                    self.abort(rid)
                except KeyError:
                    pass

    # ---- background loop and asyncio ---------------------------------------------------------------------------
    def start(self) -> None:
        """Run steps on a background thread until :meth:`stop`; submission stays thread-safe."""
        if self._thread is not None:
            return
        self._stopping = False
        self._loop_error = None
        self._thread = threading.Thread(target=self._loop, name="llmplug-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the background loop after its current step (requests left stay queued)."""
        thread = self._thread
        if thread is None:
            return
        self._stopping = True
        self._wake.set()
        thread.join(timeout)
        self._thread = None

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                if not self.scheduler.has_work() and not self._inflight and not self._inbox and not self._aborts:
                    if self.tp_requests is not None:  # idle under tensor parallelism: keep the followers' steps
                        self.step()  # coming, within their collectives' timeout
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self.step()
        except BaseException as error:  # noqa: BLE001 - surfaced to every waiter
            self._loop_error = error
            with self._lock:
                pending = list(self._requests.values())
            for request in pending:
                self._fail(request, error, [])
            self._thread = None  # start() may run a fresh loop

    def _raise_loop_error(self) -> None:
        if self._loop_error is not None:
            raise RuntimeError("the engine's background loop failed") from self._loop_error

    async def agenerate(self, prompt: Prompt, params: SamplingParams | None = None,
                        request_id: str | None = None) -> RequestOutput:
        """Await one request's final output (starts the background loop if needed)."""
        async for item in self._aevents(prompt, params, request_id):
            if isinstance(item, RequestOutput):
                return item
        raise RuntimeError("request ended without an output")

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None,
                      request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """Async iterator of one request's :class:`StreamDelta` s (starts the background loop if needed)."""
        async for item in self._aevents(prompt, params, request_id):
            if isinstance(item, StreamDelta):
                yield item

    async def _aevents(self, prompt, params, request_id):
        self.start()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        rid = self.add_request(prompt, params, request_id,
                               on_event=lambda item: loop.call_soon_threadsafe(events.put_nowait, item))
        done = False
        try:
            while not done:
                item = await events.get()
                done = isinstance(item, RequestOutput)
                yield item
        finally:  # cancelled, or the consumer left early: stop the request
            if not done:
                try:
                    self.abort(rid)
                except KeyError:
                    pass
