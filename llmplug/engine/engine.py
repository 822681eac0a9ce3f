"""``llmplug.Engine``: continuous batching over an optimized HF model.

Requests are added at any time (from any thread); each :meth:`Engine.step` asks the scheduler for the next batch,
runs it through the model runner (decode-only steps replay CUDA graphs), samples every finished row with its own
parameters and hands back what finished. While the whole running batch decodes greedily, one step runs a block of up
to ``EngineConfig.greedy_ring`` decode steps whose tokens the host reads once (:mod:`.engine_ring`).
:meth:`Engine.start` runs steps on a background thread instead, for streaming, asyncio and concurrent submission.
"""

from __future__ import annotations

import array
import collections
import itertools
import operator
import threading
import time
import warnings
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ..kv.swap import SwapSpace
from ..state import ensure_state
from .engine_ring import EngineRing, RingBlock
from .engine_spec import EngineSpeculation
from .engine_tp import RankZeroMixin, RankZeroRequests, check_params
from .metrics import EngineMetrics
from .page_table import PageTable
from .params import EngineConfig, SamplingParams
from .pending import PLACEHOLDER, PendingStep
from .request import CompletionOutput, Request, RequestOutput, Sequence, Status, StreamDelta
from .sampler import sample
from .scheduler import Scheduler, StepPlan
from .serving import Prompt, ServingMixin
from .step import StepContext, build_step, device_tensor, to_device
from .warmup import compile_attention_variants


def _deliver(request: Request, item: StreamDelta | RequestOutput) -> None:
    """Hand ``item`` to the request's callback; a failing callback (e.g. its event loop closed) stops only its own
    deliveries, never the engine."""
    try:
        request.on_event(item)
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"on_event of request {request.request_id!r} raised {error!r}; no more events for it",
                      stacklevel=2)
        request.on_event = lambda item: None
        request.stream = False


def _token_ids(prompt) -> array.array:
    """``prompt`` (a sequence or 1-D tensor of integer token ids) as an int64 array (C speed for a list of ints).

    Raises:
        TypeError: an entry that is not an integer (a float id is refused, not truncated).
        ValueError: an id beyond int64.
    """
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex():
            raise TypeError(f"a tensor prompt must be 1-D integer token ids, got shape {tuple(prompt.shape)} "
                            f"of {prompt.dtype}")
        prompt = prompt.tolist()
    try:
        return array.array("q", prompt)
    except OverflowError:
        raise ValueError(f"prompt token ids {[t for t in prompt if abs(operator.index(t)) >= 2 ** 63][:5]} are "
                         "outside the vocabulary") from None
    except TypeError as error:
        raise TypeError(f"prompt token ids must be integers: {error}") from None


class Engine(ServingMixin, RankZeroMixin):
    """Continuous-batching generation on one model (optimized in place with llmplug if it is not already).

    Args:
        model: a decoder-only HF causal LM on its device and dtype.
        config: an :class:`EngineConfig` (scheduling, preemption, prefix caching).
        tokenizer: lets requests be text and outputs carry text; needed for ``stop`` strings.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None, tokenizer=None) -> None:
        self.state = ensure_state(model)
        self.model = model
        self.config = config or EngineConfig()
        if not isinstance(self.config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(self.config).__name__}")
        self.tokenizer = tokenizer
        self.runner = self.state.runner
        self.cache = self.runner.ensure_cache()
        self.block_size = self.cache.block_size
        self.blocks = self.cache.blocks
        self.blocks.enabled = self.config.enable_prefix_caching
        swap = None
        if self.config.preemption_mode == "swap":
            swap = SwapSpace.sized(self.cache, self.config.swap_space_gb)
        self.scheduler = Scheduler(self.config, self.blocks, swap, copy_block=self.cache.copy_block)
        self.page_table = PageTable(2 * self.config.max_num_seqs + 1, self.runner.device)  # steps' block tables
        self.metrics = EngineMetrics(self.config)
        self.vocab_size = model.get_output_embeddings().out_features  # nn.Linear or a quantized lm_head
        gen = model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else model.config.get_text_config().eos_token_id
        self.eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self._requests: dict[str, Request] = {}  # every request not yet done
        self._inbox: list[Request] = []  # added, not yet seen by the scheduler
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._counter = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._loop_error: BaseException | None = None
        self._warmed = False
        # launched steps (or a greedy block) whose tokens the host has not seen yet, oldest first
        self._inflight: collections.deque[PendingStep | RingBlock] = collections.deque()
        self.speculation = EngineSpeculation(self)
        self.scheduler.on_release = self.speculation.release
        self.ring = EngineRing(self)
        tp = self.runner.tp  # requests enter on rank 0 (engine_tp); the other ranks follow()
        self.tp_requests = RankZeroRequests(self, tp) if tp is not None else None

    # ---- submission --------------------------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    on_event: Callable[[StreamDelta | RequestOutput], None] | None = None, stream: bool = True) -> str:
        """Queue a request (thread-safe); returns its id.

        Args:
            prompt: token ids (a list or a 1-D integer tensor), or text when the engine has a tokenizer.
            params: :class:`SamplingParams` (defaults when None).
            request_id: a unique id; generated when None.
            on_event: called on the engine's thread with every :class:`StreamDelta` (when ``stream``) and with the
                final :class:`RequestOutput`.
            stream: send token deltas to ``on_event`` (False: only the final output).

        Raises:
            ValueError: empty or over-long prompt, unknown token ids, text without a tokenizer, a duplicate id, a draft
                model (``params.speculative``) with another vocabulary.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: Engine(model, tokenizer=...) or pass token ids")
            text, prompt = prompt, self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        ids = _token_ids(prompt)
        self._check_prompt(ids, params)
        ids = ids.tolist()
        outside = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if outside:
            raise ValueError(f"stop_token_ids {outside} are outside the vocabulary [0, {self.vocab_size})")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} samples exceed max_num_seqs={self.config.max_num_seqs}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r} needs a tokenizer: Engine(model, tokenizer=...)")
        if params.speculative is not None:
            self.speculation.check(params.speculative)
            if self.tp_requests is not None:
                check_params(params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        with self._lock:
            order = next(self._counter)
            rid = str(request_id) if request_id is not None else f"req_{order}"
            while request_id is None and rid in self._requests:  # a caller took this name: pick the next free one
                rid = f"req_{order}_{next(self._counter)}"
            if rid in self._requests:
                raise ValueError(f"request_id={rid!r} is already in use by a running request")
            request = Request(rid, ids, params, prompt=text, order=order, stop_ids=stop_ids, on_event=on_event,
                              stream=stream and on_event is not None)
            self._requests[rid] = request
            self._inbox.append(request)
            self.speculation.live += params.speculative is not None
        self._wake.set()
        return rid

    def _check_prompt(self, ids: array.array, params: SamplingParams) -> None:
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token")
        lo, hi = torch.aminmax(torch.frombuffer(ids, dtype=torch.int64))  # no Python loop over a long prompt
        if lo.item() < 0 or hi.item() >= self.vocab_size:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        total = len(ids) + params.max_new_tokens
        if total > self.runner.max_model_len:
            raise ValueError(f"request of {total} tokens (prompt {len(ids)} + max_new_tokens={params.max_new_tokens})"
                             f" exceeds max_model_len={self.runner.max_model_len}, {self.runner.max_model_len_source}; "
                             "shorten the prompt or max_new_tokens, or raise the limit with llmplug.optimize(model, "
                             "max_model_len=...) before building the Engine (llmplug.unoptimize(model) first if it "
                             "is already optimized)")
        capacity = self.blocks.num_total * self.block_size
        if total > capacity:
            raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens={params.max_new_tokens} exceeds the whole "
                             f"KV pool ({capacity} tokens); give llmplug a bigger pool (kv_memory_fraction=...)")

    def abort(self, request_id: str) -> None:
        """Stop a request (thread-safe); its output so far is delivered with finish reason ``"abort"``."""
        with self._lock:
            if request_id not in self._requests:
                raise KeyError(f"unknown or finished request_id={request_id!r}")
            self._aborts.append(request_id)
        self._wake.set()

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._requests)

    # ---- one step ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Launch one scheduled batch, then learn an earlier batch's tokens; returns the requests that finished.

        The host learns a step's sampled tokens ``d = EngineConfig.steps_ahead`` steps late: step ``n + d`` is launched
        (its decode inputs read the tokens of the steps before on the device) before the host waits for step ``n``,
        so the GPU does not idle on the host's bookkeeping (except while a penalised or speculating request runs: they
        need every earlier token on the host, so every step in flight is read first). A sequence that stops at step
        ``n`` has up to ``d`` extra tokens computed in the steps after, then dropped.

        While every running request decodes greedily and nothing waits (:mod:`.engine_ring`), one call instead
        launches a block of up to ``EngineConfig.greedy_ring`` decode steps and then resolves the step or block in
        flight, so it may advance each sequence by several tokens (a row that stops mid-block keeps its tokens up to
        the stop); a request added or aborted meanwhile is seen by the next call.
        """
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("the engine's background loop is running: submit requests instead of calling step()")
        with self.state.step_lock:  # no generate call or other engine drives the runner meanwhile
            return self._step()

    def _step(self) -> list[RequestOutput]:
        finished: list[RequestOutput] = []
        self._take_inbox(finished)
        if self.ring.size():  # the running batch decodes greedily: a block of steps, launched before the last is read
            inflight = self._inflight
            self._resolve(finished, keep=int(bool(inflight) and self.ring.continues(inflight[-1])))
            if self.ring.run(finished):
                return finished
        speculating = self.speculation.active()
        if speculating or any(s.request.params.penalised for step in self._inflight for s in step.seqs):
            self._resolve(finished)  # drafts and penalties read every earlier token on the host: no step ahead then
        plan = self.scheduler.schedule()
        self.metrics.on_schedule(plan, self.blocks)
        launched = None
        if plan.seqs:
            try:
                if speculating:
                    launched = self.speculation.launch(plan, finished)
                else:
                    launched = self._launch(plan)
            except Exception as error:  # a failed step fails its requests; the engine keeps serving the others
                self.blocks.reset_cache()
                for seq in plan.seqs:
                    self._fail(seq.request, error, finished)
        if launched is None:
            self._resolve(finished)
            return finished
        self._inflight.append(launched)
        # a greedy block is read once a plain step follows it (the ring's rows may drop out under later steps)
        self._resolve(finished, keep=1 if isinstance(self._inflight[0], RingBlock) else self.config.steps_ahead)
        return finished

    def _launch(self, plan: StepPlan) -> PendingStep | None:
        """Run ``plan`` and sample on the device; each sampled sequence gets a placeholder token until resolved."""
        logits, rows, ctx = self._execute(plan)
        self._advance(plan)
        pending = self._sample_rows([plan.seqs[i] for i in rows], logits)
        if pending is not None and ctx.query_len == 1 and len(pending.seqs) == len(plan.seqs):
            pending.positions = ctx.positions  # the next step of these rows continues from them, on the device
        return pending

    def _advance(self, plan: StepPlan) -> None:
        """Count the step's tokens as computed and cache the blocks they filled."""
        P = self.block_size
        for seq, n in zip(plan.seqs, plan.num_new):
            seq.num_computed += n
            if seq.has_unregistered_block(P):
                seq.register_full_blocks(self.blocks)
        self.metrics.on_step(plan)

    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor) -> PendingStep | None:
        """Sample the next token of ``seqs`` (their last tokens' ``logits (R, V)``) on the device, forking requests
        with ``n > 1`` first; each gets a placeholder token until resolved."""
        if not seqs:  # only prompt chunks that end mid-prompt: nothing to sample
            return None
        forks = self._fork(seqs)
        if forks:
            picks = list(range(len(seqs))) + [seqs.index(parent) for parent, _ in forks]
            logits = logits[device_tensor(picks, logits.device)]
            seqs += [child for _, child in forks]
        tokens = sample(logits, seqs)
        if self.runner.tp is not None and not all(s.request.params.greedy for s in seqs):
            self.runner.tp.broadcast(tokens)  # rank 0's draws everywhere (greedy picks agree by themselves)
        return PendingStep(seqs, self._hold_places(seqs), tokens)

    def _hold_places(self, seqs: list[Sequence], counts: list[int] | None = None) -> list[int]:
        """Give each of ``seqs`` ``counts[i]`` placeholder tokens (one each when None: what a launched step will
        produce) -> the index of each one's first; a sequence that reaches its length limit with them is retired
        (nothing more is scheduled for it, whatever the tokens are)."""
        indices, longest = [], self.runner.max_model_len
        for seq, n in zip(seqs, counts or itertools.repeat(1)):
            ids = seq.tokens
            indices.append(len(ids))
            ids += [PLACEHOLDER] * n
            if len(ids) - seq.prompt_len >= seq.request.params.max_new_tokens or len(ids) >= longest:
                self.scheduler.retire(seq)
        return indices

    def _resolve(self, finished: list[RequestOutput], keep: int = 0) -> None:
        """Read the steps in flight, oldest first, until ``keep`` are left: wait for each one's tokens, put them in
        place, check stop conditions, stream."""
        while len(self._inflight) > keep:
            pending = self._inflight.popleft()
            if isinstance(pending, RingBlock):
                self.ring.resolve(pending, finished)
            else:
                self._resolve_step(pending, finished)

    def _resolve_step(self, pending: PendingStep, finished: list[RequestOutput]) -> None:
        values = pending.values()
        now, count, P = time.perf_counter(), 0, self.block_size
        for seq, index, token in zip(pending.seqs, pending.indices, values):
            if seq.status is Status.FINISHED:  # stopped a step earlier: this extra token is dropped
                continue
            count += 1
            seq.tokens[index] = token
            seq.resolved = index + 1
            if seq.has_unregistered_block(P):
                seq.register_full_blocks(self.blocks)
            self._check_stop(seq, token, now, finished)
        self.metrics.output_tokens += count

    def _execute(self, plan: StepPlan, num_logits: list[int] | None = None) -> tuple[torch.Tensor, list[int],
                                                                                    StepContext]:
        """Swap-ins and the forward -> ``(logits (R, V), rows, step)``: ``rows`` index the sequences whose step reaches
        their last known token, the ones to sample; ``num_logits`` (speculation) says how many of each row's last
        tokens' logits come back instead of one a sampled row."""
        for slots, blocks in plan.swap_in:
            self.scheduler.swap.swap_in(slots, blocks)
        tables = self.page_table.rows([s.blocks for s in plan.seqs])
        pending, ids, positions = self._inflight[-1] if self._inflight else None, None, None
        if pending is not None and plan.seqs == pending.seqs and plan.num_tokens == len(plan.seqs):
            # a decode step of the rows the last step sampled, in its order: its tokens are the input (and, after a
            # decode step of the same rows, its positions follow theirs), all on the device
            ids = pending.tokens
            positions = None if pending.positions is None else pending.positions + 1
        ctx = build_step(plan.seqs, plan.num_new, self.block_size, self.runner.device, input_ids=ids,
                         block_tables=tables, positions=positions, num_logits=num_logits)
        if ids is None:
            self._fill_placeholders(ctx, plan)
        logits = self.runner.step(ctx)
        rows = [i for i, (s, n) in enumerate(zip(plan.seqs, plan.num_new)) if s.num_computed + n == len(s.tokens)]
        if num_logits is None and rows and len(rows) < len(plan.seqs):
            logits = logits[device_tensor(rows, logits.device)]
        return logits, rows, ctx

    def _fill_placeholders(self, ctx: StepContext, plan: StepPlan) -> None:
        """Overwrite, on the device, the input ids that are placeholders: tokens steps in flight sampled.

        Raises:
            RuntimeError: a placeholder that no step in flight holds (a broken invariant, never a wrong token).
        """
        if not self._inflight:
            return
        moves = [([], []) for _ in self._inflight]  # per step in flight: (input rows, its token rows)
        for seq, n, start in zip(plan.seqs, plan.num_new, ctx.row_starts):
            first = seq.num_computed
            for index in range(max(first, seq.resolved), first + n):  # tokens from ``resolved`` on are placeholders
                for (dst, src), step in zip(moves, self._inflight):
                    row = step.row_of.get(id(seq))
                    if row is not None and step.last_index(row) == index:
                        dst.append(start + index - first)
                        src.append(row)
                        break
                else:
                    raise RuntimeError(f"token {index} of request {seq.request.request_id!r} is a placeholder that "
                                       "no step in flight holds")
        for (dst, src), step in zip(moves, self._inflight):
            if dst:
                index = to_device(torch.tensor([dst, src]), ctx.input_ids.device)
                ctx.input_ids[index[0]] = step.tokens[index[1]]

    def _fork(self, seqs: list[Sequence]) -> list[tuple[Sequence, Sequence]]:
        """Siblings for each request with ``n > 1`` about to sample its first token; they share its blocks."""
        forks = []
        for seq in seqs:
            request = seq.request
            if request.params.n > 1 and len(request.seqs) == 1 and seq.num_tokens == seq.prompt_len:
                for i in range(1, request.params.n):
                    child = seq.fork(i)
                    self.blocks.hold(child.blocks)
                    self.scheduler.add_running(child)
                    request.seqs.append(child)
                    forks.append((seq, child))
        return forks

    def _check_stop(self, seq: Sequence, token: int, now: float, finished: list[RequestOutput]) -> None:
        seq.token_times.append(now)
        params = seq.request.params
        reason = None
        if token in seq.request.stop_ids:
            reason = "stop"
        elif seq.resolved - seq.prompt_len >= params.max_new_tokens or seq.resolved >= self.runner.max_model_len:
            reason = "length"
        if params.stop or seq.request.stream:
            seq.text = self.tokenizer.decode(seq.known_output, skip_special_tokens=True) if self.tokenizer else None
            cut = self._find_stop(seq) if params.stop else None
            if cut is not None:
                seq.text, reason = seq.text[:cut], "stop"
        if reason is not None:
            self._finish(seq, reason, finished)
        elif seq.request.stream:
            self._emit_delta(seq)

    def _find_stop(self, seq: Sequence) -> int | None:
        """Character offset of the first stop string in ``seq.text``, or None."""
        hits = [seq.text.find(s) for s in seq.request.params.stop]
        hits = [h for h in hits if h >= 0]
        return min(hits) if hits else None

    # ---- finishing and delivery ----------------------------------------------------------------------------------
    def _finish(self, seq: Sequence, reason: str, finished: list[RequestOutput]) -> None:
        seq.finish_reason = reason
        del seq.tokens[seq.resolved:]  # tokens of steps still in flight are dropped
        self.scheduler.remove(seq)
        request = seq.request
        if request.stream:
            self._emit_delta(seq)
        if len(request.seqs) == request.params.n and all(s.status is Status.FINISHED for s in request.seqs):
            self._close(request, finished)

    def _close(self, request: Request, finished: list[RequestOutput]) -> None:
        request.done = True
        request.finish_time = time.perf_counter()
        with self._lock:
            if self._requests.pop(request.request_id, None) is not None:
                self.speculation.live -= request.params.speculative is not None
        output = self.output_of(request)
        self.metrics.on_finish(output)
        finished.append(output)
        if request.on_event is not None:
            _deliver(request, output)

    def _fail(self, request: Request, error: BaseException, finished: list[RequestOutput]) -> None:
        if request.done:
            return
        request.error = f"{type(error).__name__}: {error}"
        for seq in request.seqs:
            if seq.status is not Status.FINISHED:
                self._finish(seq, "error", finished)
        if not request.done:
            self._close(request, finished)

    def _take_inbox(self, finished: list[RequestOutput]) -> None:
        if self.tp_requests is not None:  # every rank takes rank 0's new requests and aborts
            inbox, aborts = self.tp_requests.exchange()
        else:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
        if inbox:  # new prompts must not match KV computed with weights changed since
            self.runner.forget_stale_prefixes()
        for request in inbox:
            self.scheduler.add(request.seqs[0])
        for rid in aborts:
            request = self._requests.get(rid)
            if request is None or request.done:
                continue
            for seq in request.seqs:
                if seq.status is not Status.FINISHED:
                    self._finish(seq, "abort", finished)
            if not request.done:
                self._close(request, finished)

    def _emit_delta(self, seq: Sequence) -> None:
        new_ids = seq.known_output[seq.sent_tokens:]
        text = None
        if seq.text is not None:
            # hold back a trailing partial UTF-8 character (a later token completes it) and any tail that may be the
            # start of a stop string
            ready = seq.text if seq.finish_reason else seq.text.rstrip("\ufffd")
            hold = max(map(len, seq.request.params.stop), default=1) - 1
            if hold and not seq.finish_reason:
                ready = ready[:max(len(ready) - hold, seq.sent_chars)]
            text, seq.sent_chars = ready[seq.sent_chars:], len(ready)
        seq.sent_tokens = seq.resolved - seq.prompt_len
        _deliver(seq.request, StreamDelta(seq.request.request_id, seq.index, new_ids, text,
                                         seq.finish_reason is not None, seq.finish_reason))

    def output_of(self, request: Request) -> RequestOutput:
        """The :class:`RequestOutput` of ``request`` as it stands."""
        outs = []
        for seq in request.seqs:
            text = None
            if self.tokenizer is not None:
                text = seq.text if (request.params.stop or request.stream) else \
                    self.tokenizer.decode(seq.known_output, skip_special_tokens=True)
            outs.append(CompletionOutput(seq.index, seq.known_output, text, seq.finish_reason,
                                         list(seq.token_times), self.speculation.of_sequence(seq)))
        firsts = [s.token_times[0] for s in request.seqs if s.token_times]
        return RequestOutput(request.request_id, list(request.prompt_ids), request.prompt, outs, request.done,
                             request.arrival_time, min(firsts) if firsts else None, request.finish_time,
                             request.error)

    def warmup(self, progress: bool = True) -> None:
        """Pay one-time costs now, not mid-serving (CUDA only; once per engine), with a progress bar of its phases.

        Captures the decode graph (capturing an EAGLE-3 head's layer inputs when ``EngineConfig.speculative`` drafts
        with one; the draft model's too when it drafts with a draft model) and the greedy ring's of every batch size
        up to ``max_num_seqs``, compiles the decode attention of every split count, captures the graphs of packed
        steps up to ``max_num_batched_tokens`` tokens, then serves a throwaway set of random prompts (lengths
        from 1 to ``max_num_batched_tokens``, a few tokens each), so the kernels' variants of mixed steps are compiled
        and single-sequence prefill graphs captured. Counters and prefix cache are reset.
        """
        if self._warmed or self.runner.device.type != "cuda":
            return
        self._warmed = True
        spec, config, runner = self.config.speculative, self.config, self.runner
        method = spec.method if spec is not None else None
        phases = []
        if method == "eagle3":  # its steps capture layer inputs: graphs of their own
            phases.append(("EAGLE-3 graphs", self.speculation.drafter(spec).capture))
        phases += [("decode graphs", lambda: runner.capture_decode_graphs(config.max_num_seqs,
                                                                           greedy=config.greedy_ring >= 2)),
                   ("attention variants", lambda: compile_attention_variants(runner)),
                   ("packed-step graphs", lambda: runner.capture_packed(config.max_num_batched_tokens,
                                                                        config.max_num_seqs))]
        if method == "draft":  # the draft model's decode graphs too
            phases.append(("draft model graphs", self._capture_draft_graphs))
        phases.append(("warm-up prompts", self._serve_throwaway_prompts))
        with tqdm(total=len(phases), desc="llmplug warm-up", unit="phase", disable=not progress) as bar:
            for name, run in phases:
                bar.set_postfix_str(name)
                run()
                bar.update(1)
        self.blocks.reset_cache()
        self.reset_stats()

    def _capture_draft_graphs(self) -> None:
        drafter = self.speculation.drafter(self.config.speculative)
        with drafter.state.step_lock:
            drafter.runner.capture_decode_graphs(self.config.max_num_seqs)

    def _serve_throwaway_prompts(self) -> None:
        """Random prompts of lengths from 1 to the step budget, 4 tokens each: the kernels' variants of mixed steps."""
        g = torch.Generator().manual_seed(0)
        longest = min(self.config.max_num_batched_tokens, self.runner.max_model_len - 4,
                      self.blocks.num_total * self.block_size // 8)
        lengths = sorted({max(1, longest >> i) for i in range(12)} | {1, 2, 65, 129, 257, 511})
        lengths += torch.randint(1, max(2, longest // 4), (48,), generator=g).tolist()
        prompts = [torch.randint(0, self.vocab_size, (n,), generator=g).tolist() for n in lengths if n <= longest]
        self.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True), progress=False)

    def reset_stats(self) -> None:
        """Start every counter of :meth:`stats` afresh (latencies, throughput, preemptions, prefix hits)."""
        self.metrics.reset()
        self.scheduler.num_preemptions = 0
        self.blocks.stats = type(self.blocks.stats)()
        self.speculation.reset()

    def stats(self) -> dict:
        """Latency percentiles, throughput, goodput, KV use, prefix hits, preemptions and greedy ring blocks (and the
        decode steps in them) so far; with speculation its drafts, acceptance rate and tokens a verified row gained a
        step."""
        out = self.metrics.summary(self.blocks, self.scheduler.num_preemptions)
        if self.config.speculative is not None or self.speculation.drafted:
            out["speculation"] = self.speculation.summary()
        return out
