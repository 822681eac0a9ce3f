"""Iteration-level scheduling: which sequences run how many tokens in the next step.

Every sequence has ``tokens`` and ``num_computed`` (tokens whose KV is cached); a step gives each scheduled sequence
a run of its uncomputed tokens. Decodes (one token left) come first, then running prefills continue, then swapped
sequences return, then waiting requests are admitted; prefills are chunked to fit the step's token budget, so a
long prompt never stalls running decodes. When blocks run out the last sequence in policy order is preempted. A
step's decode rows go longest context first: the decode attention kernel starts its programs in row order, so the
longest start first and the short ones fill the tail (:mod:`llmplug.ops.decode_attention`).
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

from ..kv.prefix_cache import BlockManager
from ..kv.swap import SwapSpace
from .params import EngineConfig
from .request import Sequence, Status


@dataclass
class StepPlan:
    """One step: ``seqs[i]`` computes ``num_new[i]`` tokens from position ``seqs[i].num_computed``.

    ``swap_in`` lists (cpu slots, blocks) copies to do before the forward; ``copies`` lists the copy-on-write block
    copies (src, dst) already made while planning; ``preempted`` lists sequences preempted while planning.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


def longest_first(seqs: list[Sequence]) -> list[Sequence]:
    """Decode rows in the order a step runs them: longest context first (ties keep their order)."""
    return sorted(seqs, key=operator.attrgetter("num_computed"), reverse=True)


def _seats(seq: Sequence) -> int:
    """Running sequences ``seq`` will count for: a request with ``n`` samples forks ``n - 1`` after its prompt."""
    return seq.request.params.n if len(seq.request.seqs) == 1 else 1


class Scheduler:
    """Queues of waiting, running and swapped sequences over one :class:`BlockManager`."""

    def __init__(self, config: EngineConfig, blocks: BlockManager, swap: SwapSpace | None = None,
                 copy_block: Callable[[int, int], None] | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.swap = swap
        self.copy_block = copy_block  # (src, dst): copy one block's KV at once (copy-on-write); None: no KV to copy
        self.block_size = blocks.block_size
        if config.policy == "priority":
            self.key = lambda s: (s.request.params.priority, s.request.order)
        else:
            self.key = lambda s: s.request.order
        self.waiting: list[Sequence] = []  # each queue is kept sorted by the policy's key
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        self.on_release: Callable[[Sequence], None] | None = None  # told of a sequence whose KV goes (draft KV follows)

    # ---- queues ----------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=self.key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever queue holds it and give back its blocks (finish or abort)."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self._drop_kv(seq)
        seq.status = Status.FINISHED
        if self.on_release is not None:
            self.on_release(seq)

    def retire(self, seq: Sequence) -> None:
        """Schedule nothing more for a running ``seq`` (its last token is in flight); it keeps its blocks until
        :meth:`remove`."""
        self.running.remove(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (it holds its blocks already)."""
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=self.key)

    def _drop_kv(self, seq: Sequence) -> None:
        if seq.blocks:
            self.blocks.free(seq.blocks)
        if seq.swap_slots:
            self.swap.allocator.free(seq.swap_slots)
        seq.blocks, seq.swap_slots, seq.entry_ids = [], [], []
        seq.num_computed = 0

    # ---- planning --------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        decodes, prefills = [], []
        for s in self.running:
            left = len(s.tokens) - s.num_computed
            if left == 1:
                decodes.append(s)
            elif left > 1:
                prefills.append(s)
        P, shared = self.block_size, self.blocks.is_shared
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted for an earlier sequence
                continue
            done = seq.num_computed
            n = min(len(seq.tokens) - done, budget)
            room = n == 1 and done % P and not shared(seq.blocks[done // P])  # a decode with room in its own block
            if room or self._reserve(seq, n, plan):
                plan.seqs.append(seq)
                plan.num_new.append(n)
                budget -= n
        decoding = next((i for i, n in enumerate(plan.num_new) if n != 1), len(plan.num_new))
        plan.seqs[:decoding] = longest_first(plan.seqs[:decoding])  # ties: policy order
        if not plan.preempted and self.swapped:
            budget = self._swap_in(plan, budget)
        if not plan.preempted and not self.swapped and self.waiting:
            self._admit(plan, budget)
        return plan

    def reserve(self, seqs: list[Sequence], n: int, caps: list[int], least: int = 1) -> int:
        """Pages for ``min(n, caps[i])`` more tokens of each running sequence ``seqs[i]`` (copy-on-write of a shared
        last block included) without preempting anyone: ``n`` shrinks until the free blocks hold every row's. Returns
        it, or 0 (nothing reserved) when even ``least`` tokens do not fit."""
        while n >= least and sum(self._blocks_needed(s, min(n, c)) for s, c in zip(seqs, caps)) > self.blocks.num_free:
            n -= 1
        if n < least:
            return 0
        for seq, cap in zip(seqs, caps):
            self._copy_on_write(seq, StepPlan())
            self._grow(seq, min(n, cap))
        return n

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Blocks for ``seq``'s next ``n`` tokens (copy-on-write of a shared last block), preempting later sequences
        while too few are free; False if ``seq`` itself had to be preempted."""
        while True:
            need = self._blocks_needed(seq, n)
            if not need or need <= self.blocks.num_free:
                break
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        if need:  # nothing to copy nor to grow otherwise
            self._copy_on_write(seq, plan)
            self._grow(seq, n)
        return True

    def _pages(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def _room(self) -> int:
        """Blocks a returning or new sequence may take: the free ones less the watermark (waived when alone)."""
        return self.blocks.num_free - (self._watermark() if self.running else 0)

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        P, done = self.block_size, seq.num_computed
        grow = self._pages(done + n) - len(seq.blocks)
        cow = done % P != 0 and self.blocks.is_shared(seq.blocks[done // P])
        return max(grow, 0) + int(cow)

    def _copy_on_write(self, seq: Sequence, plan: StepPlan) -> None:
        P = self.block_size
        if seq.num_computed % P == 0:
            return
        i = seq.num_computed // P
        old = seq.blocks[i]
        if self.blocks.is_shared(old):
            seq.blocks[i] = self.blocks.copy_on_write(old)
            if self.copy_block is not None:  # copied now (stream-ordered), so a later preemption sees the content
                self.copy_block(old, seq.blocks[i])
            plan.copies.append((old, seq.blocks[i]))

    def _grow(self, seq: Sequence, n: int) -> None:
        need = self._pages(seq.num_computed + n) - len(seq.blocks)
        if need > 0:
            seq.blocks.extend(self.blocks.allocate(need))

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        if self.on_release is not None:
            self.on_release(seq)
        plan.preempted.append(seq)
        if seq in plan.seqs:  # planned earlier in this step: unplan it
            i = plan.seqs.index(seq)
            del plan.seqs[i], plan.num_new[i]
        used = self._pages(seq.num_computed)
        if self.config.preemption_mode == "swap" and self.swap is not None and self.swap.allocator.num_free >= used:
            seq.swap_slots = self.swap.swap_out(seq.blocks[:used])
            self.blocks.free(seq.blocks)
            seq.blocks = []
            seq.status = Status.SWAPPED
            bisect.insort(self.swapped, seq, key=self.key)
        else:  # recompute: the full blocks stay in the prefix cache, so the rerun may find them
            self._drop_kv(seq)
            self.add(seq)

    def _swap_in(self, plan: StepPlan, budget: int) -> int:
        seats = sum(map(_seats, self.running))
        while self.swapped and budget > 0 and seats < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = self._pages(seq.num_computed + n)
            if need > self._room():
                break
            seats += 1
            self.swapped.pop(0)
            seq.blocks = self.blocks.allocate(need)
            plan.swap_in.append((seq.swap_slots, seq.blocks[:len(seq.swap_slots)]))
            seq.swap_slots = []
            self.add_running(seq)
            plan.seqs.append(seq)
            plan.num_new.append(n)
            budget -= n
        return budget

    def _watermark(self) -> int:
        return int(self.config.watermark * self.blocks.num_total)

    def _admit(self, plan: StepPlan, budget: int) -> None:
        seats = sum(map(_seats, self.running))
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats + _seats(seq) > self.config.max_num_seqs:
                break
            if seq.num_computed == 0:
                seq.blocks, seq.entry_ids = self.blocks.match(seq.tokens)
                seq.num_computed = len(seq.blocks) * self.block_size
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = self._pages(seq.num_computed + n) - len(seq.blocks)
            if need > self._room():
                self.blocks.unmatch(seq.blocks, seq.num_tokens)
                seq.blocks, seq.entry_ids, seq.num_computed = [], [], 0
                break
            self.waiting.pop(0)
            seats += _seats(seq)
            seq.blocks.extend(self.blocks.allocate(need))
            self.add_running(seq)
            plan.seqs.append(seq)
            plan.num_new.append(n)
            budget -= n
