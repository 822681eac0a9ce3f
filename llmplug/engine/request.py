"""Requests and their sequences inside the engine, and what the engine hands back for them."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..kv.prefix_cache import ROOT, BlockManager
from .page_table import PageList
from .params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted by recompute (its KV is gone)
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted, its KV in CPU swap space
    FINISHED = "finished"


class Sequence:
    """One sample of a request: ``tokens`` = prompt + output; the first ``num_computed`` have KV in ``blocks``."""

    def __init__(self, request: Request, index: int, tokens: list[int]) -> None:
        self.request = request
        self.index = index
        self.tokens = tokens
        self.prompt_len = request.prompt_len
        self.num_computed = 0
        self.resolved = len(tokens)  # leading tokens the host knows (the rest are placeholders of in-flight steps)
        self.blocks = PageList()
        self.entry_ids: list[int] = []  # prefix-cache entry id of each registered full block, in order
        self.swap_slots: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.token_times: list[float] = []
        self.text = ""  # decoded output so far (when the engine has a tokenizer)
        self.sent_tokens = 0  # tokens and characters already streamed
        self.sent_chars = 0
        seed = request.params.seed
        self.seed = None if seed is None else seed + index  # each sample of a seeded request has its own stream
        self.generator: torch.Generator | None = None  # made on the logits' device at the first sample
        self.spec_drafted = self.spec_accepted = self.spec_steps = 0  # speculation: drafts, accepted, verify steps
        self.spec_policy = None  # its AdaptiveK while it speculates adaptively

    @property
    def blocks(self) -> PageList:
        """The page id of each of its KV blocks, in order (a :class:`PageList`: the Engine's device table copies only
        what changed)."""
        return self._blocks

    @blocks.setter
    def blocks(self, pages: list[int]) -> None:
        self._blocks = PageList(pages)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def known_output(self) -> list[int]:
        """Generated tokens the host has seen (``output_ids`` may end in placeholders of in-flight steps)."""
        return self.tokens[self.prompt_len:self.resolved]

    def rollback(self, k: int, blocks: BlockManager) -> None:
        """Drop the last ``k`` tokens (rejected draft tokens): the sequence simply does not advance over them, so later
        steps overwrite their KV slots, and the pages past the new end go back to ``blocks``.

        Only tokens after the last prefix-cached block can go (a cached block's KV must never be overwritten), which
        holds for unverified tokens: blocks are registered only once every token in them is known.

        Raises:
            ValueError: ``k`` outside ``[0, generated tokens]``, or a cut into a prefix-cached block.
        """
        if not 0 <= k <= self.num_output:
            raise ValueError(f"cannot drop k={k} tokens of a sequence with {self.num_output} generated tokens")
        end = self.num_tokens - k
        if len(self.entry_ids) * blocks.block_size > end:
            raise ValueError(f"dropping {k} tokens cuts into prefix-cached block {end // blocks.block_size}")
        del self.tokens[end:]
        self.num_computed = min(self.num_computed, end)
        self.resolved = min(self.resolved, end)
        keep = -(-self.num_computed // blocks.block_size)
        blocks.free(self.blocks[keep:])
        del self.blocks[keep:]

    def has_unregistered_block(self, block_size: int) -> bool:
        """Whether a block is computed, full and known to the host but not yet in the prefix cache: what
        :meth:`register_full_blocks` would register (a cheap check, so per-step loops call that only when it does)."""
        return min(self.num_computed, self.resolved) >= (len(self.entry_ids) + 1) * block_size

    def register_full_blocks(self, blocks: BlockManager) -> None:
        """Cache every block that is computed, full, and whose tokens the host knows (never an unverified token).
        A swapped-out sequence holds no blocks: its full ones are cached once it is back."""
        P = blocks.block_size
        for j in range(len(self.entry_ids), min(min(self.num_computed, self.resolved) // P, len(self.blocks))):
            parent = self.entry_ids[-1] if self.entry_ids else ROOT
            self.entry_ids.append(blocks.register(self.blocks[j], parent, self.tokens[j * P:(j + 1) * P]))

    def fork(self, index: int) -> Sequence:
        """A sibling sharing this sequence's computed prefix (the caller holds the shared blocks once more)."""
        child = Sequence(self.request, index, list(self.tokens))
        child.num_computed = self.num_computed
        child.blocks = list(self.blocks)
        child.entry_ids = list(self.entry_ids)
        return child


@dataclass
class Request:
    """A prompt, its sampling parameters and its ``n`` sequences (one until the prompt is prefilled)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    order: int = 0  # arrival order, ties broken by submission
    seqs: list[Sequence] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    error: str | None = None
    done: bool = False  # every sample finished, or the request was aborted or failed
    finish_time: float | None = None
    on_event: Callable | None = None  # gets the final RequestOutput (engine thread), and StreamDeltas if stream
    stream: bool = False

    def __post_init__(self) -> None:
        self.seqs = [Sequence(self, 0, list(self.prompt_ids))]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class CompletionOutput:
    """One sample: ``token_ids`` generated so far, its text (with a tokenizer), why it stopped, token times; for a
    speculating request, ``speculation``: its ``drafted`` and ``accepted`` drafts, ``verified_rows`` (its verify
    steps), the ``acceptance_rate`` and the ``tokens_per_verified_row`` (None for a request that does not
    speculate)."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" (stop token or string), "length", "abort", "error" or None while running
    token_times: list[float]
    speculation: dict | None = None


@dataclass
class RequestOutput:
    """What :meth:`Engine.generate` returns per prompt, and :meth:`Engine.step` per request that moved.

    Times are ``time.perf_counter()`` seconds: ``arrival_time``, ``first_token_time`` (None before the first token)
    and ``finish_time`` (None while running); every token's time is in its completion's ``token_times``.
    """

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    error: str | None = None


@dataclass
class StreamDelta:
    """New tokens of one sample since the last delta: ``token_ids`` and their ``text`` (with a tokenizer)."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None
