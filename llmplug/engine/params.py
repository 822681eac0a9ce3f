"""``SamplingParams`` (per request) and ``EngineConfig`` (per engine), validated on construction."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .runner import GREEDY_RING

__all__ = ["EngineConfig", "SamplingParams", "SpeculativeConfig"]

_POLICIES = ("fcfs", "priority")
_PREEMPTION = ("recompute", "swap")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _as_tuple(value, kind: type) -> tuple | None:
    """``value`` as a tuple: a single ``kind`` becomes a 1-tuple; None when it is not iterable."""
    if isinstance(value, kind) and not isinstance(value, bool):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        return None


_SPEC_METHODS = ("ngram", "draft", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding in the Engine, for every request (``EngineConfig.speculative``) or one request
    (``SamplingParams.speculative``): each step, a request without penalties verifies up to ``num_tokens`` draft
    tokens (greedy ones by equality with the argmax, sampled ones by exact rejection sampling).

    Attributes:
        method: ``"ngram"`` (prompt lookup: the tokens after the latest earlier occurrence of the sequence's tail),
            ``"draft"`` (greedy tokens of ``draft_model``) or ``"eagle3"`` (greedy tokens of an EAGLE-3 ``head``).
        num_tokens: most draft tokens a request verifies in one step (1-15).
        adaptive: each request's draft count follows its own measured acceptance and the step's decoding rows
            (:class:`~llmplug.spec.adaptive.AdaptiveK`'s weight-bound estimate), down to none for blocks of 16 steps
            with a probe after each; False: always ``num_tokens`` (where the pages and the step's budget allow).
        max_ngram, min_ngram: tail lengths prompt lookup tries, longest first.
        draft_model: for ``"draft"``: an HF causal LM with the target's tokenizer (its ids must be ids the target
            embeds), usually a much smaller one. The engine puts it on llmplug (its own runner and paged KV pool,
            sized by its own ``optimize`` settings, e.g. ``llmplug.optimize(draft, kv_num_blocks=...)`` beforehand)
            and keeps one draft state per draft model, whichever configs name it. Compared and hashed by identity.
        head: for ``"eagle3"``: ``llmplug.load_eagle3(dir, model)``'s proposer for the engine's model. The engine
            captures the model's layer inputs the head reads at every step while a request drafts with it; a request
            whose prompt came partly from the prefix cache (no layer inputs for those positions) goes without drafts.
            One head per engine. Compared and hashed by identity.
    """

    method: str = "ngram"
    num_tokens: int = 4
    adaptive: bool = True
    max_ngram: int = 2
    min_ngram: int = 1
    draft_model: torch.nn.Module | None = None
    head: object | None = None

    def __post_init__(self) -> None:
        _check(self.method in _SPEC_METHODS, f"method={self.method!r} is not one of {_SPEC_METHODS}")
        _check(_is_int(self.num_tokens) and 1 <= self.num_tokens <= 15,
               f"num_tokens={self.num_tokens!r} must be an int in [1, 15]")
        _check(isinstance(self.adaptive, bool), f"adaptive={self.adaptive!r} must be True or False")
        _check(_is_int(self.min_ngram) and _is_int(self.max_ngram) and 1 <= self.min_ngram <= self.max_ngram,
               f"need ints 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram!r}, max_ngram={self.max_ngram!r}")
        if self.method == "draft":
            _check(self.draft_model is not None, "method='draft' needs draft_model= (an HF causal LM with the model's "
                                                 "tokenizer)")
            model = self.draft_model
            _check(isinstance(model, torch.nn.Module) and hasattr(model, "config")
                   and callable(getattr(model, "get_output_embeddings", None)),
                   f"draft_model must be an HF causal LM (a torch.nn.Module with a config and an output embedding), "
                   f"got {type(model).__name__}")
        else:
            _check(self.draft_model is None, f"draft_model is only for method='draft', not method={self.method!r}")
        if self.method == "eagle3":
            _check(all(callable(getattr(self.head, a, None)) for a in ("observe", "propose", "forget"))
                   and getattr(self.head, "aux_layers", None),
                   f"method='eagle3' needs head= (llmplug.load_eagle3(dir, model)), got {type(self.head).__name__}")
        else:
            _check(self.head is None, f"head is only for method='eagle3', not method={self.method!r}")

    def __repr__(self) -> str:
        model = "None" if self.draft_model is None else f"<{type(self.draft_model).__name__}>"
        head = "None" if self.head is None else f"<{type(self.head).__name__}>"
        return (f"SpeculativeConfig(method={self.method!r}, num_tokens={self.num_tokens}, adaptive={self.adaptive}, "
                f"max_ngram={self.max_ngram}, min_ngram={self.min_ngram}, draft_model={model}, head={head})")

    def __deepcopy__(self, memo) -> SpeculativeConfig:
        return self  # immutable; a copy must name the same draft model (the engine keeps one draft state per model)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. ``temperature == 0`` (or ``do_sample=False``) is greedy.

    Attributes:
        max_new_tokens: tokens to generate at most.
        min_new_tokens: stop tokens are masked out until this many tokens were generated.
        temperature, top_k (0: off), top_p (1.0: off), min_p (0.0: off): sampling, applied in that order.
        repetition_penalty: HF's multiplicative penalty over prompt and output tokens (1.0: off).
        frequency_penalty, presence_penalty: OpenAI-style additive penalties over output tokens (0.0: off).
        seed: makes this request's samples reproducible whatever else runs in the batch.
        stop_token_ids: tokens that end the request (kept in the output); the engine adds the model's eos ids
            unless ``ignore_eos``.
        stop: strings that end the request (needs a tokenizer); the output text is cut before them.
        ignore_eos: generate ``max_new_tokens`` whatever the model emits.
        n: samples per prompt; they share the prompt's KV blocks.
        priority: lower runs first under the ``"priority"`` policy.
        speculative: this request's :class:`SpeculativeConfig`; None: the engine's (``EngineConfig.speculative``).
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0
    do_sample: bool = True
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False
    n: int = 1
    priority: int = 0
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
               f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        _check(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
               f"min_new_tokens={self.min_new_tokens!r} must be an int in [0, max_new_tokens={self.max_new_tokens}]")
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               f"temperature={self.temperature!r} must be a number >= 0 (0: greedy)")
        _check(_is_int(self.top_k) and self.top_k >= 0, f"top_k={self.top_k!r} must be an int >= 0 (0: off)")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, f"top_p={self.top_p!r} must be in (0, 1]")
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p < 1, f"min_p={self.min_p!r} must be in [0, 1)")
        _check(isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0,
               f"repetition_penalty={self.repetition_penalty!r} must be > 0 (1.0: off)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and -2 <= value <= 2, f"{name}={value!r} must be in [-2, 2]")
        _check(self.seed is None or _is_int(self.seed), f"seed={self.seed!r} must be an int or None")
        ids = _as_tuple(self.stop_token_ids, int)
        _check(ids is not None and all(_is_int(t) and t >= 0 for t in ids),
               f"stop_token_ids={self.stop_token_ids!r} must be ints >= 0")
        object.__setattr__(self, "stop_token_ids", ids)
        stop = _as_tuple(self.stop, str)
        _check(stop is not None and all(isinstance(s, str) and s for s in stop),
               f"stop={self.stop!r} must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        _check(_is_int(self.n) and self.n >= 1, f"n={self.n!r} must be an int >= 1")
        _check(_is_int(self.priority), f"priority={self.priority!r} must be an int")
        _check(self.speculative is None or isinstance(self.speculative, SpeculativeConfig),
               f"speculative={self.speculative!r} must be a SpeculativeConfig or None")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty and no minimum length: the argmax of the logits as they come."""
        return self.greedy and not self.penalised and not self.min_new_tokens

    @functools.cached_property
    def penalised(self) -> bool:
        """Whether a repetition, frequency or presence penalty reads the earlier tokens."""
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling and memory settings of an :class:`llmplug.Engine`.

    Attributes:
        max_num_seqs: sequences running at once at most.
        max_num_batched_tokens: tokens per step (decodes first, then prefill chunks fill the rest).
        policy: ``"fcfs"`` (arrival order) or ``"priority"`` (``SamplingParams.priority``, then arrival).
        watermark: share of KV blocks a new request must leave free when admitted (room for running decodes).
        preemption_mode: when blocks run out, ``"recompute"`` drops a victim's KV and prefills it again later;
            ``"swap"`` copies it to pinned CPU memory and back.
        swap_space_gb: CPU memory for swapped-out KV blocks.
        enable_prefix_caching: share full KV blocks of equal prefixes between requests.
        slo_ttft_s, slo_tpot_s: latency targets that ``stats()`` counts goodput against.
        speculative: a :class:`SpeculativeConfig` for every request that sets none of its own (None: only requests
            with ``SamplingParams.speculative`` speculate). While a request speculates, steps wait for the previous
            step's tokens (drafts are proposed from them) instead of running one step ahead.
        greedy_ring: while every running request decodes greedily (no penalties, stop strings or speculation) and
            nothing else waits, one step runs a block of up to this many decode steps and the host reads their tokens
            once (CUDA graph replays with the token chosen on the device, the next block launched before the last is
            read; a row that reaches its length mid-block stops there on the device); 0 or 1 (the default): one decode
            step a call. At most 16. Off by default: the one-step-ahead pipeline already hides the host's work where
            the GPU step is the longer one (H200, 1B: (b) 0-1.0% faster, (a) within its noise; the 8B not measured
            since blocks stopped idling the GPU on their read; BENCHMARKS.md); it pays where the host is slower than
            the model (tiny models, CPU).
        steps_ahead: plain steps launched before the host reads a step's tokens (1: the next step is launched, then
            the last one read; 2: two steps in flight, so a host stall up to a GPU step long idles nothing). A sequence
            that stops on a token has up to this many extra tokens computed, then dropped, and outputs come this many
            steps after their tokens are computed. 1 to 4.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    policy: str = "fcfs"
    watermark: float = 0.01
    preemption_mode: str = "recompute"
    swap_space_gb: float = 4.0
    enable_prefix_caching: bool = True
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.1
    speculative: SpeculativeConfig | None = None
    greedy_ring: int = 0
    steps_ahead: int = 1

    def __post_init__(self) -> None:
        _check(_is_int(self.max_num_seqs) and self.max_num_seqs >= 1,
               f"max_num_seqs={self.max_num_seqs!r} must be an int >= 1")
        _check(_is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 16,
               f"max_num_batched_tokens={self.max_num_batched_tokens!r} must be an int >= 16")
        _check(self.policy in _POLICIES, f"policy={self.policy!r} is not one of {_POLICIES}")
        _check(isinstance(self.watermark, (int, float)) and 0 <= self.watermark < 0.5,
               f"watermark={self.watermark!r} must be in [0, 0.5)")
        _check(self.preemption_mode in _PREEMPTION,
               f"preemption_mode={self.preemption_mode!r} is not one of {_PREEMPTION}")
        _check(isinstance(self.swap_space_gb, (int, float)) and self.swap_space_gb >= 0,
               f"swap_space_gb={self.swap_space_gb!r} must be >= 0")
        _check(isinstance(self.enable_prefix_caching, bool),
               f"enable_prefix_caching={self.enable_prefix_caching!r} must be True or False")
        for name in ("slo_ttft_s", "slo_tpot_s"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and value > 0, f"{name}={value!r} must be > 0")
        _check(self.speculative is None or isinstance(self.speculative, SpeculativeConfig),
               f"speculative={self.speculative!r} must be a SpeculativeConfig or None")
        _check(_is_int(self.greedy_ring) and 0 <= self.greedy_ring <= GREEDY_RING,
               f"greedy_ring={self.greedy_ring!r} must be an int in [0, {GREEDY_RING}] (0 or 1: off)")
        _check(_is_int(self.steps_ahead) and 1 <= self.steps_ahead <= 4,
               f"steps_ahead={self.steps_ahead!r} must be an int in [1, 4]")
