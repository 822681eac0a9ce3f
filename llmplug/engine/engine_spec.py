"""The Engine's speculative steps: requests verify drafts (prompt lookup, a draft model, an EAGLE-3 head) inside
continuous batching.

Each step, a running request without penalties whose next token is a decode and that speculates (its
``SamplingParams.speculative``, else ``EngineConfig.speculative``) gets up to ``num_tokens`` drafts (with
``adaptive``, as many as its own acceptance so far pays for, :class:`~llmplug.spec.adaptive.AdaptiveK`) when the pool
has pages for them without preempting anyone and the step's token budget allows: with ``method="ngram"`` the tokens
after the latest earlier occurrence of its tail, with ``method="draft"`` the draft model's greedy tokens
(:mod:`.engine_draft`: every row of a draft model drafted together, its KV kept in the draft's own pool), with
``method="eagle3"`` an EAGLE-3 head's greedy tokens (:mod:`.engine_eagle`: the model's layer inputs captured at every
step). The step computes the request's last token and the drafts and returns all their logits. A greedy request keeps
the drafts while they equal the argmax, then the argmax after them (exactly greedy decoding's tokens); a sampled one
verifies them by exact rejection sampling against the sampler's distribution (temperature, top-k/p, min-p; its own
generator when seeded), so its tokens follow the same distribution. Rejected drafts are not counted as computed and
their pages past the new end go back to the pool; they were never registered in the prefix cache (only known tokens
are). Other rows of the step (prefill chunks, penalised requests) run as usual.
"""

from __future__ import annotations

import itertools
import time

import torch

from ..spec.adaptive import RIDGE_TOKENS, AdaptiveK
from ..spec.draft import check_draft_model
from ..spec.ngram import propose_ngram
from ..spec.rejection import greedy_accept, rejection_sample
from ..state import ensure_state
from .engine_draft import EngineDrafter
from .engine_eagle import EngineEagle
from .params import SpeculativeConfig
from .request import RequestOutput, Sequence, Status
from .runner import MAX_GRAPH_QUERY
from .sampler import generator_of, sampling_probs
from .scheduler import StepPlan
from .step import device_tensor

# A filled step's graph keeps every token's logits, (tokens, vocab), captured mid-serving after the KV pool took its
# memory: at most this many tokens (64 MB of bf16 logits at a 128k vocabulary) a graph. Not measured yet.
MAX_FILLED_TOKENS = 256


def _unpenalised(seq: Sequence) -> bool:
    """Rows whose next-token distribution does not depend on earlier tokens beyond the model (no penalties, no
    min-new-tokens mask left): every verified position then has the sampler's distribution of its logits."""
    p = seq.request.params
    return not p.penalised and seq.num_output >= p.min_new_tokens


def _report(drafted: int, accepted: int, rows: int) -> dict:
    """Speculation counters (drafts, accepted drafts, verify rows) and the rates derived from them."""
    return {"drafted": drafted, "accepted": accepted, "verified_rows": rows,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_verified_row": (accepted + rows) / rows if rows else 0.0}


class EngineSpeculation:
    """Drafts, verification and acceptance for one :class:`~llmplug.engine.engine.Engine`.

    Attributes:
        drafted, accepted, steps: drafts proposed, drafts accepted and verify rows so far (for ``stats()``).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.drafted = self.accepted = self.steps = 0
        self.live = 0  # requests not yet done with speculation settings of their own (the engine counts them)
        # one per draft model (or EAGLE-3 head), made on the engine's thread
        self.drafters: dict[object, EngineDrafter | EngineEagle] = {}
        if engine.config.speculative is not None:
            self.check(engine.config.speculative)

    def check(self, cfg: SpeculativeConfig) -> None:
        """Raise unless ``cfg``'s draft model or head (if any) can draft for the engine's model; put a draft model on
        llmplug."""
        if cfg.method == "eagle3":
            layers = self.engine.runner.num_layers
            if max(cfg.head.aux_layers) >= layers:
                raise ValueError(f"the EAGLE-3 head reads layers {tuple(cfg.head.aux_layers)} but the model has "
                                 f"{layers}: a head must be loaded for this model (llmplug.load_eagle3(dir, model))")
            heads = {d.head for d in self.drafters.values() if isinstance(d, EngineEagle)} | {cfg.head}
            if len(heads) > 1:
                raise ValueError("one EAGLE-3 head per engine: its requests already draft with another head")
            return
        if cfg.method != "draft":
            return
        if cfg.draft_model is self.engine.model:
            raise ValueError("draft_model is the engine's model itself: a draft model must be a smaller (or a copied) "
                             "model")
        check_draft_model(cfg.draft_model, self.engine.model, "draft_model")
        ensure_state(cfg.draft_model)

    def drafter(self, cfg: SpeculativeConfig) -> EngineDrafter | EngineEagle:
        """The engine's state for ``cfg``'s draft model or EAGLE-3 head (made on first use, on the engine's thread)."""
        key = cfg.head if cfg.method == "eagle3" else cfg.draft_model
        drafter = self.drafters.get(key)
        if drafter is None:
            drafter = self.drafters[key] = EngineEagle(key, self.engine.runner) if cfg.method == "eagle3" else \
                EngineDrafter(key, self.engine.config.max_num_batched_tokens)
        return drafter

    def release(self, seq: Sequence) -> None:
        """``seq`` gave up its KV (finished, aborted, failed or preempted): so does its draft side."""
        for drafter in self.drafters.values():
            drafter.release(seq)

    def config_of(self, seq: Sequence) -> SpeculativeConfig | None:
        """The request's own speculation settings, else the engine's (None: it does not speculate)."""
        return seq.request.params.speculative or self.engine.config.speculative

    def active(self) -> bool:
        """Whether any request not yet done speculates (steps then wait for the previous step's tokens)."""
        return self.engine.config.speculative is not None or self.live > 0

    def summary(self) -> dict:
        """Drafts proposed and accepted, the acceptance rate and the tokens a verified row gained per step."""
        return _report(self.drafted, self.accepted, self.steps)

    def of_sequence(self, seq: Sequence) -> dict | None:
        """``seq``'s own :meth:`summary` (its :class:`CompletionOutput`'s), or None when its request does not
        speculate."""
        return None if self.config_of(seq) is None else _report(seq.spec_drafted, seq.spec_accepted, seq.spec_steps)

    def reset(self) -> None:
        """Start the counters of :meth:`summary` afresh."""
        self.drafted = self.accepted = self.steps = 0

    def launch(self, plan: StepPlan, finished: list[RequestOutput]):
        """Run ``plan`` with drafts for its eligible rows; accept them now, sample the other rows as usual (returns
        their pending tokens, or None)."""
        engine = self.engine
        eagles = [(i, self.drafter(cfg)) for i, cfg in enumerate(map(self.config_of, plan.seqs))
                  if cfg is not None and cfg.method == "eagle3"]
        for _, eagle in eagles:
            eagle.capture()
        drafts = self._propose(plan)
        fill = self._fill(plan, drafts)
        for seq, d, f in zip(plan.seqs, drafts, fill):
            seq.tokens.extend(d + d[-1:] * f)  # fillers: verified like drafts, never accepted
        plan.num_new = [n + len(d) + f for n, d, f in zip(plan.num_new, drafts, fill)]
        ends = [s.num_computed + n == s.num_tokens for s, n in zip(plan.seqs, plan.num_new)]
        counts = [(1 + len(d) + f) if end else 0 for d, f, end in zip(drafts, fill, ends)]
        firsts = [s.num_computed for s in plan.seqs]
        logits, rows, _ = engine._execute(plan, num_logits=counts)
        states = engine.runner.aux_hidden if eagles else None  # (T, A): every token's layer inputs, read below
        engine._advance(plan)
        starts = list(itertools.accumulate(counts, initial=0))
        verified = [i for i in rows if drafts[i]]
        known = list(plan.num_new)  # tokens of each row known for good: all, but a verified row's kept ones
        if verified:
            emitted = self._accept([plan.seqs[i] for i in verified], [drafts[i] for i in verified], logits,
                                   [starts[i] for i in verified], finished, [fill[i] for i in verified])
            for i, n in zip(verified, emitted):
                known[i] = n
        tokens = list(itertools.accumulate(plan.num_new, initial=0))
        for i, eagle in eagles:
            seq = plan.seqs[i]
            if seq.status is not Status.FINISHED:
                eagle.observe(seq, firsts[i], None if states is None else states[tokens[i]:tokens[i] + known[i]])
        sampled = [i for i in rows if not drafts[i]]
        if not sampled:
            return None
        picks = device_tensor([starts[i] for i in sampled], logits.device)
        return engine._sample_rows([plan.seqs[i] for i in sampled], logits[picks])

    def _propose(self, plan: StepPlan) -> list[list[int]]:
        """Drafts for each row of ``plan`` (empty where it gets none), their pages allocated."""
        engine = self.engine
        blocks = engine.blocks
        budget = engine.config.max_num_batched_tokens - plan.num_tokens
        out = []
        wants: dict = {}  # per draft model or head: (row, pages taken for its drafts)
        decoding = sum(n == 1 and s.num_computed == s.num_tokens - 1 for s, n in zip(plan.seqs, plan.num_new))
        for i, (seq, n) in enumerate(zip(plan.seqs, plan.num_new)):
            d: list[int] = []
            p, cfg = seq.request.params, self.config_of(seq)
            if (cfg is not None and budget > 0 and n == 1 and seq.num_computed == seq.num_tokens - 1
                    and seq.resolved == seq.num_tokens and _unpenalised(seq) and len(seq.request.seqs) == p.n):
                k = min(self._draft_count(seq, cfg, decoding), budget, p.max_new_tokens - seq.num_output - 1,
                        engine.runner.max_model_len - seq.num_tokens - 1)
                if k > 0:  # a draft model's k tokens are drafted below, all its rows at once
                    d = propose_ngram(torch.tensor(seq.tokens), k, cfg.max_ngram, cfg.min_ngram).tolist() \
                        if cfg.method == "ngram" else [-1] * k
                need = self._pages(seq, seq.num_tokens + len(d))
                if d and need > 0:
                    if need <= blocks.num_free:
                        seq.blocks.extend(blocks.allocate(need))
                    else:
                        d = []
                if d and cfg.method != "ngram":
                    wants.setdefault(self.drafter(cfg), []).append((i, need))
            budget -= len(d)
            out.append(d)
        for drafter, rows in wants.items():
            drafts = drafter.propose([plan.seqs[i] for i, _ in rows], [len(out[i]) for i, _ in rows])
            for (i, taken), d in zip(rows, drafts):
                out[i] = d
                if not d and taken:  # no drafts after all: the pages taken for them go back
                    seq = plan.seqs[i]
                    blocks.free(seq.blocks[-taken:])
                    del seq.blocks[-taken:]
        return out

    def _draft_count(self, seq: Sequence, cfg: SpeculativeConfig, rows: int) -> int:
        """Drafts ``seq`` asks for in a step of ``rows`` decoding rows: ``cfg.num_tokens``, or with ``cfg.adaptive``
        its own :class:`~llmplug.spec.adaptive.AdaptiveK`'s choice from its acceptance so far (0 turns its drafts off
        for ``probe_every`` steps, then it probes)."""
        if not cfg.adaptive:
            return cfg.num_tokens
        if seq.spec_policy is None:
            seq.spec_policy = AdaptiveK(cfg.num_tokens, RIDGE_TOKENS.get(self.engine.runner.device.type, 4.0))
        return seq.spec_policy.choose_step(rows)

    def _fill(self, plan: StepPlan, drafts: list[list[int]]) -> list[int]:
        """Filler tokens each row verifies after its drafts, so that a step of one-token rows that all draft is uniform
        (every row ``1 + max(drafts)`` tokens) and replays the runner's CUDA graph of (rows bucket, that length)
        instead of running eagerly; zeros where the step would not replay one (other rows, no graphs, more than
        ``MAX_FILLED_TOKENS`` tokens) or the pool has no pages for the fillers."""
        engine = self.engine
        rows = len(plan.seqs)
        if not all(drafts) or any(n != 1 for n in plan.num_new) or not self._graphed(rows):
            return [0] * rows
        k = max(map(len, drafts))
        fill = [k - len(d) for d in drafts]
        blocks = engine.blocks
        need = [self._pages(s, s.num_tokens + k) for s in plan.seqs]
        if k + 1 > MAX_GRAPH_QUERY or rows * (k + 1) > MAX_FILLED_TOKENS or sum(need) > blocks.num_free:
            return [0] * rows
        for seq, n in zip(plan.seqs, need):
            if n:
                seq.blocks.extend(blocks.allocate(n))
        return fill

    def _pages(self, seq: Sequence, tokens: int) -> int:
        """Pages ``seq`` lacks to hold ``tokens`` tokens (0 if none)."""
        return max(0, -(-tokens // self.engine.block_size) - len(seq.blocks))

    def _graphed(self, rows: int) -> bool:
        """Whether a uniform step of ``rows`` rows replays a CUDA graph here."""
        return self.engine.runner.graph_bucket(rows) is not None

    def _accept(self, seqs: list[Sequence], drafts: list[list[int]], logits: torch.Tensor, starts: list[int],
                finished: list[RequestOutput], fill: list[int]) -> list[int]:
        """Verify every row's drafts at once (row ``i``'s last token and drafts have ``logits[starts[i]:][:1 + k_i]``)
        and read the result once; keep what the target agrees with (:meth:`Sequence.rollback` drops the rest), then
        the target's own next token, with stop checks token by token. Returns each row's kept tokens (its last token
        and the accepted drafts)."""
        engine, dev = self.engine, logits.device
        k = max(map(len, drafts))
        index = device_tensor([[s + min(j, len(d)) for j in range(k + 1)] for s, d in zip(starts, drafts)], dev)
        block = logits[index]  # (R, k + 1, V); a row's positions past its drafts repeat its last one (never used)
        drafted = device_tensor([d + [0] * (k - len(d)) for d in drafts], dev)
        counts = device_tensor([len(d) for d in drafts], dev)
        out = torch.empty((len(seqs), k + 2), dtype=torch.long, device=dev)
        greedy = [i for i, s in enumerate(seqs) if s.request.params.greedy]
        sampled = [i for i, s in enumerate(seqs) if not s.request.params.greedy]
        for group in (greedy, sampled):
            if not group:
                continue
            rows = device_tensor(group, dev)
            if group is greedy:
                tokens, emitted = greedy_accept(block[rows], drafted[rows], counts[rows])
            else:  # exact rejection sampling; the drafts are deterministic (prompt lookup, greedy draft model)
                probs = sampling_probs(block[rows].flatten(0, 1), [seqs[i] for i in group for _ in range(k + 1)])
                tokens, emitted = rejection_sample(probs.view(len(group), k + 1, -1), drafted[rows], counts[rows],
                                                   generators=[generator_of(seqs[i], dev) for i in group])
            out[rows] = torch.cat([tokens, emitted[:, None]], dim=1)
        if sampled and engine.runner.tp is not None:
            engine.runner.tp.broadcast(out)  # rank 0's draws everywhere (greedy acceptance agrees by itself)
        now = time.perf_counter()
        kept = []
        for seq, d, f, row in zip(seqs, drafts, fill, out.tolist()):  # one read of the device
            emitted = row[-1]
            start = seq.num_tokens - len(d) - f
            seq.rollback(len(d) + f - (emitted - 1), engine.blocks)  # rejected drafts and fillers; accepted ones stay
            seq.tokens.append(row[emitted - 1])
            self.drafted += len(d)
            self.accepted += emitted - 1
            self.steps += 1
            seq.spec_drafted += len(d)
            seq.spec_accepted += emitted - 1
            seq.spec_steps += 1
            if seq.spec_policy is not None:
                seq.spec_policy.record(len(d), emitted - 1)
            kept.append(emitted)
            for pos in range(start, seq.num_tokens):
                seq.resolved = pos + 1
                engine.metrics.output_tokens += 1
                seq.register_full_blocks(engine.blocks)
                engine._check_stop(seq, seq.tokens[pos], now, finished)
                if seq.status is Status.FINISHED:
                    break
        return kept
