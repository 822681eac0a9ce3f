"""Runs one step of the model (:class:`~llmplug.engine.step.StepContext`) on the paged KV pool.

Uniform steps (every row the same number of new tokens: decodes, speculative verifies) replay CUDA graphs captured per
(batch-size bucket, query length); single-sequence prefill chunks replay graphs captured per token bucket; everything
else runs eagerly. The greedy and sampling graphs add the choice of the next token to a decode step. While a caller
wants some layers' input hidden states (an EAGLE-3 head, :meth:`ModelRunner.capture_aux`), every step also leaves
them in ``runner.aux_hidden``; graphs captured so are kept beside the others, under keys that name the layers.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch

from ..config import OptimizeConfig
from ..kv.cache import PagedKVCache, kv_storage_dtype
from ..ops._triton import programmatic_launch
from ..ops.greedy_step import NO_LIMIT, advance_step, greedy_step
from ..parallel.group import TPGroup
from ..parallel.shard import head_split
from ..spec.rejection import greedy_accept
from .attention import ATTENTION_NAME
from .hf_layers import HFLayers
from .metadata import AttentionMetadata
from .packed_graphs import PackedGraphs
from .step import StepContext, uniform_metadata

# (runner, input_ids (T,), positions (T,), logits_indices (B,) or None) -> logits (B, V)
ForwardFn = Callable[["ModelRunner", torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

_MAX_BLOCKS = 1 << 18
MAX_GRAPH_QUERY = 16  # longest query a row of a uniform step may have for its step to replay a CUDA graph
MAX_EOS = 8  # end-of-sequence ids a greedy graph checks on the device
GREEDY_RING = 16  # greedy graph steps between two reads of their tokens by the host
MAX_SAMPLE_GRAPHS = 4  # sampling graphs kept (one per batch size and sampler settings)
POSITION_ONLY_ROPE = {"default", "linear", "llama3", "yarn"}  # rope types whose cos/sin depend on the position alone


def hf_forward(runner: ModelRunner, input_ids: torch.Tensor, positions: torch.Tensor,
               logits_indices: torch.Tensor | None) -> torch.Tensor:
    """The model's own HF forward with llmplug attention swapped in (any decoder-only family); with
    :meth:`ModelRunner.capture_aux` on, HF's ``output_hidden_states`` (entry ``i`` is layer ``i``'s input)."""
    keep = logits_indices if logits_indices is not None else 0
    aux = runner.aux_layers
    with runner.llmplug_attention():
        out = runner.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                           logits_to_keep=keep, **({"output_hidden_states": True} if aux else {}))
    if aux:
        runner.aux_hidden = torch.cat([out.hidden_states[i][0] for i in aux], dim=-1)
    return out.logits[0]


class ModelRunner:
    """Owns the KV pool, the current step's metadata and the decode graphs of one optimized model."""

    def __init__(self, model: torch.nn.Module, config: OptimizeConfig, forward_fn: ForwardFn,
                 tp: TPGroup | None = None) -> None:
        self.model = model
        self.config = config
        self.forward_fn = forward_fn
        self.tp = tp  # the tensor-parallel group the weights are split over (its KV heads are this rank's)
        self.meta: AttentionMetadata | None = None
        text = model.config.get_text_config()
        self.num_layers = text.num_hidden_layers
        self.num_heads = text.num_attention_heads  # this rank's query heads (kv heads below), split under TP
        self.num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        if tp is not None:
            self.num_heads, self.num_kv_heads = head_split(text.num_attention_heads, self.num_kv_heads, tp.size)
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.max_model_len = config.max_model_len or getattr(text, "max_position_embeddings", 8192)
        if config.max_model_len is not None:  # where the limit comes from, for error messages
            self.max_model_len_source = f"set by llmplug.optimize(model, max_model_len={config.max_model_len})"
        elif getattr(text, "max_position_embeddings", None) is not None:
            self.max_model_len_source = "the model's max_position_embeddings"
        else:
            self.max_model_len_source = "llmplug's default (the model config has no max_position_embeddings)"
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, self.dtype)
        self.cache: PagedKVCache | None = None
        self._weights_version: int | None = None  # the weights the prefix cache's KV was computed with
        self._warned_untracked = False  # said once that inference-tensor weights keep no prefix cache
        self._graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}
        self._pool = None  # one CUDA-graph memory pool shared by every captured graph
        self._hf_configs = self._attention_configs()
        self.aux_layers: tuple[int, ...] = ()  # layers whose inputs each step captures (capture_aux)
        self.aux_hidden: torch.Tensor | None = None  # (T, len(aux_layers) * hidden): the last step's, when capturing
        # HF's dynamic / longrope rotary embeddings read position values on the host: no graph capture then. Where
        # every rope type depends on the position alone, a forward may tabulate cos/sin once (rope_by_position).
        rope = getattr(text, "rope_parameters", None) or {}
        kinds = {rope.get("rope_type")} | {v.get("rope_type") for v in rope.values() if isinstance(v, dict)}
        kinds = {kind or "default" for kind in kinds}
        self.rope_by_position = kinds <= POSITION_ONLY_ROPE
        self._graphs_allowed = (config.cuda_graphs and self.device.type == "cuda"
                                and not kinds & {"dynamic", "longrope"})
        # packed steps as graphs captured per token bucket; under TP a graph keeps its all-reduces' captured order,
        # and every forward opens with the NCCL fence (llmplug.parallel.one_shot), as the decode graphs do
        self.packed_graphs = None
        if self._graphs_allowed and config.packed_graph_tokens:
            # (uncompiled under TP: the one-shot all-reduce alternates its buffer slot in Python; Dynamo would fix it)
            layers = HFLayers(model, compile=tp is None) if forward_fn is hf_forward else forward_fn
            if hasattr(layers, "body"):
                self.packed_graphs = PackedGraphs(self, layers, config.packed_graph_tokens)

    # ---- KV pool -------------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.kv_block_size

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def ensure_cache(self) -> PagedKVCache:
        """Allocate the KV pool on first use (sized by ``kv_num_blocks`` or ``kv_memory_fraction``)."""
        if self.cache is None:
            per_block = PagedKVCache.bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads,
                                                     self.head_dim, self.kv_dtype)
            n = self.config.kv_num_blocks
            if n is None:
                n = PagedKVCache.budget_bytes(self.device, self.config.kv_memory_fraction) // per_block
                n = min(n, _MAX_BLOCKS)
            if n < 1:
                raise MemoryError(f"no memory left for a single KV page of {per_block} bytes on {self.device}")
            self.cache = PagedKVCache(self.num_layers, n, self.block_size, self.num_kv_heads, self.head_dim,
                                      self.kv_dtype, self.device)
        return self.cache

    def forget_stale_prefixes(self) -> None:
        """Drop the prefix cache's entries when the weights changed since they were computed: an in-place update
        (an optimizer step, ``load_state_dict``) bumps a parameter's version counter, a replaced one its storage.
        Parameters without a version counter (inference tensors) make every check drop them. Nothing to check while
        the pool caches no prefix (the walk over the parameters is skipped)."""
        if self.cache is None or not self.cache.blocks.enabled:
            self._weights_version = None  # the next check, once caching is on, starts afresh
            return
        try:
            version = hash(tuple((p.data_ptr(), p._version) for p in self.model.parameters()))
        except RuntimeError:  # inference tensors keep no version counter
            version = None
            if not self._warned_untracked:
                self._warned_untracked = True
                warnings.warn("the model's parameters are inference tensors (made under torch.inference_mode), whose "
                              "in-place updates cannot be seen: llmplug drops the prefix cache whenever new prompts "
                              "arrive, so prompts share no KV across calls; load the model outside inference_mode to "
                              "keep it", stacklevel=3)
        if version is None or version != self._weights_version:
            if self.cache is not None:
                self.cache.blocks.reset_cache()
            self._weights_version = version

    def release(self) -> None:
        """Free the KV pool and graphs (``unoptimize``); later graphs start a new memory pool (PyTorch does not
        capture into a pool whose graphs are all gone)."""
        self._graphs.clear()
        if self.packed_graphs is not None:
            self.packed_graphs.clear()
        self._pool = None
        self.cache = None
        self.meta = None

    def capture_aux(self, layers: tuple[int, ...] | None) -> None:
        """From now on every :meth:`step` also leaves ``aux_hidden``: ``(T, len(layers) * hidden)``, the inputs of
        ``layers`` (0: the embeddings) at each of the step's ``T`` tokens, concatenated in the order given; read it
        before the next step (a graph replay overwrites it). ``None`` or ``()`` turns capture off. Graphs captured
        without it stay for later and cost nothing meanwhile; graphs with it are captured on first use.

        Raises:
            ValueError: a layer outside ``0 .. num_layers - 1``.
        """
        layers = tuple(layers or ())
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"aux layers {bad} outside the model's layers 0..{self.num_layers - 1}")
        self.aux_layers, self.aux_hidden = layers, None

    def _key(self, *parts) -> tuple:
        """A graph's key: ``parts``, plus the captured layers while :meth:`capture_aux` is on."""
        return parts + (self.aux_layers,) if self.aux_layers else parts

    # ---- HF attention switch -------------------------------------------------------------------------------
    def _attention_configs(self) -> list:
        configs = {id(m.config): m.config for m in self.model.modules()
                   if hasattr(m, "layer_idx") and hasattr(m, "config")}
        return list(configs.values()) or [self.model.config]

    @contextlib.contextmanager
    def llmplug_attention(self):
        """Point the model's attention modules at llmplug's paged attention for the duration of a step."""
        saved = [c._attn_implementation_internal for c in self._hf_configs]
        for c in self._hf_configs:
            c._attn_implementation_internal = ATTENTION_NAME
        try:
            yield
        finally:
            for c, s in zip(self._hf_configs, saved):
                c._attn_implementation_internal = s

    # ---- steps ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, ctx: StepContext) -> torch.Tensor:
        """Run one step -> logits ``(R, V)`` of the rows ``ctx.logits_indices`` (every token row if None).

        A uniform step of up to ``MAX_GRAPH_QUERY`` tokens a row that wants every row's logits (decodes, verifies)
        replays the CUDA graph of its (rows bucket, query length), padding rows at position -1 (never stored, never
        read); one sequence's chunk of up to ``max(graph_prefill_tokens)`` tokens whose last logits are wanted replays
        the graph of its token bucket (pad tokens follow the real ones and are never stored). Other packed steps
        replay the graph of their token bucket where :meth:`capture_packed` captured one
        (:mod:`~llmplug.engine.packed_graphs`) and run eagerly otherwise.
        """
        q, rows, tokens = ctx.query_len, ctx.num_rows, ctx.input_ids.shape[0]
        every_row = ctx.logits_indices is None and q <= MAX_GRAPH_QUERY
        bucket = self.graph_bucket(rows) if q and every_row else None
        if bucket is not None:
            return self._replay_uniform(ctx, bucket)
        positions, meta = ctx.positions, ctx.meta
        if q:
            positions, meta = uniform_metadata(ctx.positions, ctx.block_tables, self.block_size, q,
                                               every_token=ctx.logits_indices is None)
        chunk = next((t for t in self.config.graph_prefill_tokens if t >= tokens), None)
        if self._graphs_allowed and rows == 1 and q != 1 and chunk is not None and ctx.logits_indices is not None:
            return self._replay_prefill(ctx.input_ids, positions, meta, ctx.logits_indices, chunk)
        packed = None
        if self.packed_graphs is not None and not self.aux_layers:
            packed = self.packed_graphs.bucket(meta, tokens)
        if packed is not None:
            return self.packed_graphs.run(ctx.input_ids, positions, meta, ctx.logits_indices, packed)
        return self._forward(ctx.input_ids, positions, meta, ctx.logits_indices)

    @torch.inference_mode()
    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_indices: torch.Tensor | None) -> torch.Tensor:
        """Eager forward: ``input_ids, positions (T,)`` -> logits ``(R, V)`` of the rows ``logits_indices``."""
        self.ensure_cache()
        self.meta = meta
        try:
            with programmatic_launch():  # the step's kernels may overlap their predecessors' tails (weights are fixed)
                return self.forward_fn(self, input_ids, positions, logits_indices)
        finally:
            self.meta = None

    @torch.inference_mode()
    def capture_packed(self, max_tokens: int, max_seqs: int) -> list[int]:
        """Capture the graph of every token bucket a packed step of up to ``max_tokens`` tokens and ``max_seqs``
        sequences uses (CUDA, graphs on; none where the model's layers cannot be split or captured); returns the
        captured buckets."""
        return [] if self.packed_graphs is None else self.packed_graphs.capture(max_tokens, max_seqs)

    def graph_bucket(self, batch: int) -> int | None:
        """The captured batch size a uniform step of ``batch`` rows runs in, or None (eager)."""
        if not self._graphs_allowed:
            return None
        return next((b for b in self.config.graph_batch_sizes if b >= batch), None)

    @torch.inference_mode()
    def capture_decode_graphs(self, max_batch: int, greedy: bool = False) -> int:
        """Capture every decode graph a batch of up to ``max_batch`` rows can use now (with ``greedy``, every greedy
        token-loop graph too, :meth:`greedy_graph`); returns how many decode graphs exist."""
        if not self._graphs_allowed:
            return 0
        top = self.graph_bucket(max_batch) or self.config.graph_batch_sizes[-1]
        for bucket in self.config.graph_batch_sizes:
            if bucket > top:
                continue
            if self._key("step", bucket, 1) not in self._graphs:
                self._capture_uniform(bucket, 1)
            if greedy:
                self.greedy_graph(bucket)
        return sum(key == self._key("step", key[1], 1) for key in self._graphs if key[0] == "step")

    def _replay_prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        logits_indices: torch.Tensor, chunk: int) -> torch.Tensor:
        tokens = input_ids.shape[0]
        graph, buf = self._graphs.get(self._key("prefill", chunk)) or self._capture_prefill(chunk)
        buf["input_ids"][:tokens].copy_(input_ids)
        torch.add(buf["offsets"], positions[:1], out=buf["positions"])
        buf["slot_mapping"][:tokens].copy_(meta.slot_mapping)
        buf["slot_mapping"][tokens:].fill_(-1)
        buf["block_tables"][:, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        buf["context_lens"].copy_(meta.context_lens)
        buf["logits_indices"].copy_(logits_indices)
        graph.replay()
        if self.aux_layers:
            self.aux_hidden = buf["aux"][:tokens]
        return buf["logits"]

    def _replay_uniform(self, ctx: StepContext, bucket: int) -> torch.Tensor:
        """``ctx``'s rows in the graph of (``bucket`` rows, its query length) -> logits of its ``B * Q`` token rows."""
        q, rows = ctx.query_len, ctx.num_rows
        graph, buf = self._graphs.get(self._key("step", bucket, q)) or self._capture_uniform(bucket, q)
        buf["input_ids"][:rows * q].copy_(ctx.input_ids)
        buf["positions"][:rows].copy_(ctx.positions)
        buf["block_tables"][:rows, :ctx.block_tables.shape[1]].copy_(ctx.block_tables)
        if rows < bucket:
            buf["positions"][rows:].fill_(-1)
        graph.replay()
        if self.aux_layers:
            self.aux_hidden = buf["aux"][:rows * q]
        return buf["logits"][:rows * q]

    @torch.inference_mode()
    def greedy_graph(self, batch: int) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]] | None:
        """The greedy decode graph of ``batch``'s bucket, or None where decode steps run eagerly.

        One replay is a decode step plus :func:`~llmplug.ops.greedy_step.greedy_step` on its buffers: the token it
        picks becomes the next replay's input and positions advance on the device, so consecutive replays need no
        host work but the pages a row grows into (``block_tables``). Buffers: ``input_ids, positions (rows,)``,
        ``block_tables``, ``unfinished (rows,) bool``, ``eos (MAX_EOS,)`` padded with -1, ``pad (1,)``,
        ``ring (rows, GREEDY_RING)`` (step ``s`` writes column ``s % GREEDY_RING``), ``counters (2,)``.
        """
        bucket = self.graph_bucket(batch)
        if bucket is None:
            return None
        key = self._key("greedy", bucket)
        return self._graphs.get(key) or self._capture_token_loop(key, bucket, None)

    @torch.inference_mode()
    def sample_graph(self, batch: int, processors, key) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]] | None:
        """Like :meth:`greedy_graph`, but the token is sampled as HF's ``_sample`` does: ``processors`` (stateless
        logits warpers, which ignore ``input_ids``) on fp32 logits, softmax, ``torch.multinomial``.

        Captured for exactly ``batch`` rows (``multinomial``'s use of the random stream depends on the row count, so
        this keeps stock HF's seeded samples) and per ``key`` (the processors' settings, which the graph bakes in);
        the ``MAX_SAMPLE_GRAPHS`` most recent are kept. The random state is restored after the capture's warm-up,
        and every replay draws from the default CUDA generator like an eager step. None where steps run eagerly.
        """
        if self.graph_bucket(batch) is None:
            return None
        full = self._key("sample", batch, key)
        if full in self._graphs:
            self._graphs[full] = self._graphs.pop(full)  # most recently used last
            return self._graphs[full]
        samples = [k for k in self._graphs if k[0] == "sample"]
        for old in samples[:max(0, len(samples) + 1 - MAX_SAMPLE_GRAPHS)]:  # the least recently used
            del self._graphs[old]
        state = torch.cuda.get_rng_state(self.device)
        try:
            return self._capture_token_loop(full, batch, processors)
        finally:
            torch.cuda.set_rng_state(state, self.device)

    @torch.inference_mode()
    def greedy_verify(self, ids: list[list[int]], firsts: list[int], counts: list[int], tables: torch.Tensor,
                      drafts: torch.Tensor | None = None) -> torch.Tensor | None:
        """Launch a greedy verify step as one graph replay: the uniform step of (rows bucket, ``q``) and the acceptance
        (:func:`~llmplug.spec.rejection.greedy_accept`) on the device, the host inputs in one copy -> ``(rows, q + 1)``
        on the device, each row its emitted tokens padded with -1 to ``q`` and, last, how many it emitted (a view of
        the graph's buffer: read it before the next call); None where steps run eagerly (no graphs, ``q`` too long).
        While :meth:`capture_aux` is on, ``aux_hidden`` holds the step's ``(rows * q, A)``, as after any step.

        The GPU waits for the host between two verify steps (the drafts need the accepted tokens), so each launch
        and copy there lengthens the step. NOTE: H100, Llama-3-8B shape, oracle at alpha 0.8, batch 1: 2.54x ->
        2.69x with this graph and the measured-cost policy together (BENCHMARKS.md, "Speculative decoding: verify
        graph, ...").

        Args:
            ids: per row ``q`` token ids: its last emitted token, then its drafts (padded with any id past ``counts``).
            firsts: per row the position of its first token (its KV is computed below it).
            counts: per row how many of its ``q - 1`` drafts are real.
            tables: ``(rows, M)`` the rows' device page tables (pages for ``firsts + q`` tokens).
            drafts: ``(rows, q - 1)`` on the device, in place of ``ids``' draft columns (the host never waits for them).
        """
        rows, q = len(ids), len(ids[0])
        bucket = self.graph_bucket(rows)
        if bucket is None or q > MAX_GRAPH_QUERY:
            return None
        graph, buf = self._graphs.get(self._key("verify", bucket, q)) or self._capture_verify(bucket, q)
        pad = bucket - rows
        flat = [t for row in ids for t in row] + [0] * (pad * q) + firsts + [-1] * pad + counts + [0] * pad
        host = buf["host"]
        host.copy_(torch.tensor(flat, dtype=torch.long))
        # the caller read the previous call's result, which the device wrote after this buffer's last copy: it is free
        buf["staged"].copy_(host, non_blocking=True)
        if drafts is not None:
            buf["input_ids"].view(bucket, q)[:rows, 1:].copy_(drafts)
        buf["block_tables"][:rows, :tables.shape[1]].copy_(tables)
        graph.replay()
        if self.aux_layers:
            self.aux_hidden = buf["aux"][:rows * q]
        return buf["result"][:rows]

    def _capture_verify(self, bucket: int, q: int):
        dev = self.device
        staged = torch.zeros(bucket * q + 2 * bucket, dtype=torch.long, device=dev)  # ids, positions, draft counts
        buf = self._buffers(bucket, bucket * q)
        buf.update(staged=staged, input_ids=staged[:bucket * q], positions=staged[bucket * q:bucket * (q + 1)],
                   counts=staged[bucket * (q + 1):], result=torch.zeros(bucket, q + 1, dtype=torch.long, device=dev))
        buf["positions"].fill_(-1)

        def step():
            logits = self._uniform_forward(buf, q)
            drafted = buf["input_ids"].view(bucket, q)[:, 1:]
            tokens, emitted = greedy_accept(logits.view(bucket, q, -1), drafted, buf["counts"])
            buf["result"][:, :q].copy_(tokens)
            buf["result"][:, q].copy_(emitted)
            return logits

        graph, buf = self._capture(self._key("verify", bucket, q), buf, step)
        buf["host"] = torch.empty(staged.numel(), dtype=torch.long, pin_memory=True)
        return graph, buf

    def _capture_token_loop(self, key, rows: int, processors):
        dev = self.device
        buf = self._buffers(rows, rows)
        buf.update(unfinished=torch.zeros(rows, dtype=torch.bool, device=dev),
                   eos=torch.full((MAX_EOS,), -1, dtype=torch.long, device=dev),
                   pad=torch.zeros(1, dtype=torch.long, device=dev),
                   ring=torch.zeros(rows, GREEDY_RING, dtype=torch.long, device=dev),
                   limits=torch.full((rows,), NO_LIMIT, dtype=torch.long, device=dev),
                   counters=torch.zeros(2, dtype=torch.long, device=dev))
        state = [buf[k] for k in ("unfinished", "eos", "pad", "ring", "input_ids", "positions", "limits", "counters")]

        def step():
            logits = self._uniform_forward(buf)
            if processors is None:
                with programmatic_launch():
                    greedy_step(logits, *state)
            else:  # HF's _sample on this step's logits
                scores = processors(buf["input_ids"][:, None], logits.to(copy=True, dtype=torch.float32))
                advance_step(torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1), *state)
            return logits

        return self._capture(key, buf, step)

    @staticmethod
    def arm_token_loop(buf: dict[str, torch.Tensor], tokens: torch.Tensor, positions: torch.Tensor,
                       tables: torch.Tensor, unfinished: torch.Tensor | bool, eos: torch.Tensor, pad: int,
                       limits: torch.Tensor | None = None) -> None:
        """Load a token-loop graph's buffers (:meth:`greedy_graph`, :meth:`sample_graph`) for ``R`` rows: their input
        ``tokens (R,)``, ``positions (R,)``, page ``tables (R, M)`` and ``unfinished`` flags (``(R,)`` bool, or one
        value for all), the ``eos`` ids the device stops on (``(E,)``, ``E <= MAX_EOS``), the ``pad`` id, the
        positions ``limits (R,)`` at which rows stop computing (None: none do) and a zeroed step counter; the bucket's
        other rows are padding (position -1)."""
        count = tokens.shape[0]
        buf["input_ids"][:count].copy_(tokens)
        buf["positions"].fill_(-1)
        buf["positions"][:count].copy_(positions)
        buf["limits"].fill_(NO_LIMIT)
        if limits is not None:
            buf["limits"][:count].copy_(limits)
        buf["unfinished"].zero_()
        buf["unfinished"][:count] = unfinished
        buf["eos"].fill_(-1)
        buf["eos"][:eos.numel()].copy_(eos)
        buf["pad"].fill_(pad)
        buf["counters"].zero_()
        buf["block_tables"][:count, :tables.shape[1]].copy_(tables)

    def _buffers(self, rows: int, tokens: int) -> dict[str, torch.Tensor]:
        """Graph inputs: ``input_ids (tokens,)``, ``positions (rows,)`` (each row's first position),
        ``block_tables (rows, M)``."""
        dev = self.device
        return {
            "input_ids": torch.zeros(tokens, dtype=torch.long, device=dev),
            "positions": torch.full((rows,), -1, dtype=torch.long, device=dev),
            "block_tables": torch.zeros(rows, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
        }

    def _capture_uniform(self, bucket: int, query_len: int):
        buf = self._buffers(bucket, bucket * query_len)
        return self._capture(self._key("step", bucket, query_len), buf, lambda: self._uniform_forward(buf, query_len))

    def _uniform_forward(self, buf: dict[str, torch.Tensor], query_len: int = 1) -> torch.Tensor:
        """One uniform step on a graph's buffers (``input_ids``, ``positions``, ``block_tables``) -> every row's
        logits."""
        positions, meta = uniform_metadata(buf["positions"], buf["block_tables"], self.block_size, query_len,
                                           every_token=True)
        return self._forward(buf["input_ids"], positions, meta, None)

    def _capture_prefill(self, tokens: int):
        dev = self.device
        buf = self._buffers(1, tokens)
        buf["positions"] = torch.zeros(tokens, dtype=torch.long, device=dev)  # every token's
        buf.update(
            offsets=torch.arange(tokens, device=dev),
            slot_mapping=torch.full((tokens,), -1, dtype=torch.long, device=dev),
            cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
            context_lens=torch.zeros(1, dtype=torch.int32, device=dev),
            logits_indices=torch.zeros(1, dtype=torch.long, device=dev),
        )
        meta = AttentionMetadata(query_len=0, slot_mapping=buf["slot_mapping"], block_tables=buf["block_tables"],
                                 cu_seqlens_q=buf["cu_seqlens_q"], context_lens=buf["context_lens"],
                                 max_seqlen_q=tokens)
        return self._capture(self._key("prefill", tokens), buf,
                             lambda: self._forward(buf["input_ids"], buf["positions"], meta, buf["logits_indices"]))

    def capture_graph(self, step, tokens: int) -> tuple[torch.cuda.CUDAGraph, object]:
        """Warm ``step`` (a forward of ``tokens`` tokens) up twice on a side stream (Triton and Dynamo compile, cuBLAS
        picks kernels, lazy buffers are made), then capture it into a graph of the runner's memory pool ->
        ``(graph, what step returned)``. With ``gemm_tuning`` on, the fused forward's GEMMs at ``tokens`` rows are
        tuned first (:meth:`~llmplug.patches.decoder.FusedDecoder.tune_gemms`)."""
        self.ensure_cache()
        if self.config.gemm_tuning and hasattr(self.forward_fn, "tune_gemms"):
            self.forward_fn.tune_gemms(tokens)
        dev = self.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool()):
            out = step()
        return graph, out

    def _capture(self, key, buf: dict[str, torch.Tensor], step):
        """:meth:`capture_graph` of ``step``, keeping its outputs (the logits, and the captured layer inputs while
        :meth:`capture_aux` is on)."""
        graph, buf["logits"] = self.capture_graph(step, buf["input_ids"].numel())
        if self.aux_layers:
            buf["aux"] = self.aux_hidden
        self._graphs[key] = (graph, buf)
        return graph, buf

    def _graph_pool(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool
