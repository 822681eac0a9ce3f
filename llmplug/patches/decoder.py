"""The fused forward shared by the Llama-like families (llama, mistral, qwen2, qwen3, gemma*, phi3).

Per layer: fused residual-add + RMSNorm (at one token, inside the next GEMV's prologue where that pays), one q/k/v
GEMM, per-head q/k RMSNorm where the family has it, RoPE in place, paged attention, one gate/up GEMM, gated
activation. The HF modules keep their weights (the fused q/k/v and gate/up weights are views shared with them), so
the stock HF forward keeps working beside this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..engine.attention import rope_paged_attention
from ..ops import ksplit_gemm, skinny_gemv, tuned_gemm
from ..ops.act_mul import act_and_mul
from ..ops.gemv import add_norm_gemv, gemv, norm_in_prologue
from ..ops.rms_norm import add_rms_norm, parts_add_rms_norm, rms_norm, round_first_for
from ..parallel.group import TPGroup
from ..parallel.linear import RowParallel
from ..parallel.shard import head_split
from ..quant.linear import QuantLinear, fuse_quant_linears
from .undo import UndoLog

_ROPE_TABLE_MAX_BYTES = 128 << 20  # RoPE cos/sin tables up to this size are built (see FusedDecoder._rotary)


@dataclass(frozen=True)
class FamilySpec:
    """How one HF family differs from Llama.

    Attributes:
        model_types: HF ``config.model_type`` values this spec covers.
        norm_offset: RMSNorm weight offset (Gemma's ``1 + w`` is 1.0).
        sandwich_norms: Gemma 2/3: norms after attention and MLP outputs too.
        window_from_config: the sliding window lives on the config, not the attention module (Mistral, Phi-3).
        rope_per_layer_type: Gemma 3: the rotary embedding takes the layer type (local vs global RoPE).
    """

    model_types: tuple[str, ...]
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    window_from_config: bool = False
    rope_per_layer_type: bool = False


class Dense:
    """A plain weight (and bias) as the fused forward calls it: ``dense.matmul(x) -> (M, N)``.

    One token on CUDA (batch-1 decode) goes through llmplug's GEMV, which reads the weight at a higher rate than
    cuBLAS's small-N kernels and applies a gate/up activation in its epilogue, up to ``skinny_gemv.MAX_ROWS`` tokens
    (a verify step at batch 1) through its few-row form; at a row count it holds a cuBLASLt choice for
    (``tuned``, set by :meth:`FusedDecoder.tune_gemms`) through that; everything else through ``F.linear``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.tuned: dict[int, tuned_gemm.Choice] = {}  # rows -> the algorithm timed fastest there

    def matmul(self, x: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
        """``x: (M, K)`` -> ``(M, N)``; with ``fp32_out`` in fp32, unrounded (a row-parallel rank's share)."""
        if x.is_cuda and x.shape[0] <= skinny_gemv.MAX_ROWS:
            if x.shape[0] == 1:
                return gemv(x, self.weight, self.bias, fp32_out=fp32_out)
            return skinny_gemv.skinny_gemv(x, self.weight, self.bias, fp32_out=fp32_out)
        if not fp32_out or x.dtype == torch.float32:
            choice = self.tuned.get(x.shape[0]) if self.tuned else None
            out = None if choice is None else tuned_gemm.matmul(choice, x, self.weight)
            return F.linear(x, self.weight, self.bias) if out is None else out
        if x.is_cuda:
            out = torch.mm(x, self.weight.t(), out_dtype=torch.float32)  # cuBLAS, fp32 accumulators kept
            return out if self.bias is None else out + self.bias.float()
        return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())

    def summands(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x (M, K) @ W^T`` as ``(S, M, N)`` fp32 partial products over K slices where the fixed rule of
        :func:`~llmplug.ops.ksplit_gemm.splits` says that is faster (a down projection at 9-256 rows on CUDA), for a
        consumer that sums them (:func:`~llmplug.ops.rms_norm.parts_add_rms_norm`); None otherwise."""
        slices = 0 if self.bias is not None else ksplit_gemm.splits(x, self.weight)
        return ksplit_gemm.ksplit_matmul(x, self.weight, slices) if slices else None

    def gated_matmul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """``act(x @ W_gate^T) * (x @ W_up^T)`` for a fused gate/up weight (gate rows first): ``(M, K)`` ->
        ``(M, N / 2)``; a few tokens on CUDA in the GEMV's epilogue."""
        if x.is_cuda and x.shape[0] <= skinny_gemv.MAX_ROWS:
            if x.shape[0] == 1:
                return gemv(x, self.weight, self.bias, gated=activation)
            return skinny_gemv.skinny_gemv(x, self.weight, self.bias, gated=activation)
        return act_and_mul(self.matmul(x), activation)


Linear = Dense | QuantLinear  # both offer matmul(x) and gated_matmul(x, activation)


def _linear_of(module: torch.nn.Module) -> Linear:
    return module if isinstance(module, QuantLinear) else Dense(module.weight, module.bias)


def _fuse(modules: list[torch.nn.Module], log: UndoLog) -> Linear:
    """One linear computing the concatenated outputs of ``modules`` (all dense, or all quantized alike)."""
    if all(isinstance(m, QuantLinear) for m in modules):
        return fuse_quant_linears(modules, log)
    if any(isinstance(m, QuantLinear) for m in modules):
        raise NotImplementedError("cannot fuse quantized with unquantized projections; quantize all or none")
    weight = log.fuse_parameters([m.weight for m in modules])
    bias = log.fuse_parameters([m.bias for m in modules]) if modules[0].bias is not None else None
    return Dense(weight, bias)


@dataclass
class _Layer:
    qkv: Linear
    o: Linear | RowParallel
    gate_up: Linear
    down: Linear | RowParallel
    q_size: int
    kv_size: int
    scale: float
    window: int | None
    softcap: float | None
    rope_key: str | None
    module: torch.nn.Module = field(repr=False)


def _eps(norm: torch.nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _fuse_attention(attn: torch.nn.Module, log: UndoLog) -> Linear:
    if hasattr(attn, "qkv_proj"):  # Phi-3 ships it fused
        return _linear_of(attn.qkv_proj)
    return _fuse([attn.q_proj, attn.k_proj, attn.v_proj], log)


def _fuse_mlp(mlp: torch.nn.Module, log: UndoLog) -> Linear:
    if hasattr(mlp, "gate_up_proj"):  # Phi-3
        return _linear_of(mlp.gate_up_proj)
    if mlp.gate_proj.bias is not None:
        raise NotImplementedError("MLP biases are not fused")
    return _fuse([mlp.gate_proj, mlp.up_proj], log)


def text_decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder stack the fused forward runs, found by HF's ``get_decoder()``: ``model.model`` of a causal LM, the
    language model inside a multimodal wrapper (``model.model.language_model`` of Gemma3ForConditionalGeneration,
    Llava, ...). None unless it has ``layers``, ``embed_tokens``, ``norm`` and ``rotary_emb``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return decoder if all(hasattr(decoder, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb")) else None


class FusedDecoder:
    """Prepared (fused) weights of one model plus its forward over flat token lists."""

    def __init__(self, model: torch.nn.Module, spec: FamilySpec, activation: str, log: UndoLog,
                 tp: TPGroup | None = None) -> None:
        self.spec = spec
        self.activation = activation
        self.base = text_decoder(model)
        self.lm_head = _linear_of(model.lm_head)
        self.tp = tp  # the weights are this rank's slices (llmplug.parallel.shard): reduce and gather around them
        text = model.config.get_text_config()
        self.vocab = text.vocab_size
        self.final_softcap = getattr(text, "final_logit_softcapping", None)
        self.layers = []
        for layer in self.base.layers:
            attn = layer.self_attn
            head_dim = attn.head_dim
            n_heads = getattr(attn, "num_heads", None) or text.num_attention_heads
            n_kv = getattr(attn, "num_key_value_heads", None) or text.num_key_value_heads
            if tp is not None:
                n_heads, n_kv = head_split(n_heads, n_kv, tp.size)
            o, down = _linear_of(attn.o_proj), _linear_of(layer.mlp.down_proj)
            if tp is not None:
                o, down = (RowParallel(lin, tp, fp32_shares=isinstance(lin, Dense)) for lin in (o, down))
            window = getattr(text, "sliding_window", None) if spec.window_from_config else \
                getattr(attn, "sliding_window", None)
            self.layers.append(_Layer(
                qkv=_fuse_attention(attn, log), o=o, gate_up=_fuse_mlp(layer.mlp, log), down=down,
                q_size=n_heads * head_dim, kv_size=n_kv * head_dim, scale=float(attn.scaling),
                window=window, softcap=getattr(attn, "attn_logit_softcapping", None),
                rope_key=getattr(attn, "layer_type", None) if spec.rope_per_layer_type else None, module=layer,
            ))
        self.head_dim = self.base.layers[0].self_attn.head_dim
        self._rope_keys = {layer.rope_key for layer in self.layers}
        self._rope_tables: dict[str | None, torch.Tensor] | None = None  # built on first use; {}: not tabulated

    def plain_linears(self) -> dict[tuple[int, int], list[Dense]]:
        """Its bias-free plain linears (the lm_head's too) by weight shape ``(N, K)``."""
        groups: dict[tuple[int, int], list[Dense]] = {}
        for lin in [x for lay in self.layers for x in (lay.qkv, lay.o, lay.gate_up, lay.down)] + [self.lm_head]:
            if isinstance(lin, Dense) and lin.bias is None:
                groups.setdefault(tuple(lin.weight.shape), []).append(lin)
        return groups

    def tune_gemms(self, rows: int) -> None:
        """Give each plain linear the cuBLASLt algorithm :func:`~llmplug.ops.tuned_gemm.tune` finds fastest for
        ``rows`` rows of its shape, where one beats ``F.linear``."""
        groups = self.plain_linears()
        found = tuned_gemm.tune({shape: [lin.weight for lin in lins] for shape, lins in groups.items()}, rows)
        for shape, choice in found.items():
            for lin in groups[shape]:
                lin.tuned[rows] = choice

    def _norm(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        return rms_norm(x, norm.weight, _eps(norm), self.spec.norm_offset)

    def _add_norm_matmul(self, linear: Linear, producer: Linear | None, x: torch.Tensor, residual: torch.Tensor,
                         norm: torch.nn.Module, gated: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """``(linear(rms_norm(hidden + residual)), hidden + residual)`` with ``hidden = producer.matmul(x)`` (``x``
        itself when ``producer`` is None), gated when asked.

        One token on CUDA: between two quantized GEMVs that can (:meth:`QuantLinear.norm_gemv`) the producer's
        epilogue adds the residual and starts the norm, the consumer's finishes it
        (:meth:`QuantLinear.matmul_add_norm`), no norm kernel; with a plain weight where it pays
        (:func:`~llmplug.ops.gemv.norm_in_prologue`) the norm runs in the GEMV's prologue
        (:func:`~llmplug.ops.gemv.add_norm_gemv`). NOTE: both shorten the decode graph replay (H200 / H100, 2026-11-22;
        BENCHMARKS.md, "Norm in the GEMV's prologue", "Earlier: the RMSNorm split between the quantized GEMVs").
        At 9-256 rows a plain long-K producer (a down projection) leaves fp32 partial products over K slices, which
        the add + norm sums (:mod:`~llmplug.ops.ksplit_gemm`)."""
        eps, offset = _eps(norm), self.spec.norm_offset
        if (isinstance(producer, QuantLinear) and isinstance(linear, QuantLinear) and producer.norm_gemv(x)
                and linear.norm_gemv(x)):
            out, residual, parts = producer.matmul_add_norm(x, residual, norm.weight, offset)
            if gated:
                return linear.gated_matmul(out, gated, rstd_parts=parts, eps=eps), residual
            return linear.matmul(out, rstd_parts=parts, eps=eps), residual
        prologue = (isinstance(linear, Dense) and x.shape[0] == 1 and x.is_cuda and x.dtype == linear.weight.dtype
                    and norm_in_prologue(linear.weight.numel()))
        if isinstance(producer, RowParallel) and not prologue:  # the all-reduce, the add and the norm: one kernel
            x, residual = producer.all_reduce_add_norm(x, residual, norm.weight, eps, offset,
                                                       round_first_for(offset, None))
        else:
            parts = producer.summands(x) if isinstance(producer, Dense) else None  # None at one row (prologue)
            if parts is not None:  # the GEMM's K slices, summed by the add + norm (llmplug.ops.ksplit_gemm)
                x, residual = parts_add_rms_norm(parts, residual, norm.weight, eps, offset)
            else:
                hidden = x if producer is None else producer.matmul(x)
                if prologue:
                    return add_norm_gemv(hidden, residual, norm.weight, eps, offset, linear.weight, linear.bias,
                                         gated=gated)
                x, residual = add_rms_norm(hidden, residual, norm.weight, eps, offset)
        return (linear.gated_matmul(x, gated) if gated else linear.matmul(x)), residual

    def _rotary_emb(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str | None, tuple]:
        """HF's rotary module on ``positions (T,)``: ``{rope key: (cos (T, R), sin (T, R))}`` in ``hidden.dtype``."""
        embs = {k: self.base.rotary_emb(hidden, positions[None], *([k] if k is not None else []))
                for k in self._rope_keys}
        return {k: (cos[0], sin[0]) for k, (cos, sin) in embs.items()}

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor, runner) -> dict[str | None, tuple]:
        """cos and sin ``(T, R)`` per rope key for ``positions (T,)``.

        Where every rope type depends on the position alone (``runner.rope_by_position``), they are rows of a
        ``(max_model_len, 2, R)`` table that HF's rotary module fills on first use (the same values, its products and
        cosines being per element): one gather a step instead of the module's eight or so small kernels. Other rope
        types (dynamic, longrope), and tables over ``_ROPE_TABLE_MAX_BYTES``, call the module. NOTE: faster decode
        graph replay, same greedy tokens (H200, 2026-11-22; BENCHMARKS.md, "H200 re-measured").
        """
        if self._rope_tables is None:
            length = runner.max_model_len
            size = len(self._rope_keys) * length * 2 * self.head_dim * hidden.element_size()
            self._rope_tables = {}
            if runner.rope_by_position and size <= _ROPE_TABLE_MAX_BYTES:
                embs = self._rotary_emb(hidden[:1], torch.arange(length, device=hidden.device))
                self._rope_tables = {k: torch.stack(cs, dim=1) for k, cs in embs.items()}
        if not self._rope_tables:
            return self._rotary_emb(hidden, positions)
        rows = {k: table.index_select(0, positions) for k, table in self._rope_tables.items()}
        return {k: (r[:, 0], r[:, 1]) for k, r in rows.items()}

    def __call__(self, runner, input_ids: torch.Tensor, positions: torch.Tensor,
                 logits_indices: torch.Tensor | None) -> torch.Tensor:
        """``input_ids, positions: (T,)`` -> logits ``(B, V)`` for rows ``logits_indices`` (all rows if None). With
        :meth:`~llmplug.engine.runner.ModelRunner.capture_aux` on, the inputs of those layers (each layer's residual
        stream after its first add) go to ``runner.aux_hidden``."""
        hidden, residual = self.body(runner, input_ids, positions)
        return self.head(hidden, residual, logits_indices)

    def attention(self, runner, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s paged attention of the step ``runner.meta`` describes: ``q (T, H, D)``, ``k, v (T, Hkv, D)``
        before RoPE (``cos, sin (T, R)``; ``q, k`` may be rotated in place) -> ``(T, H, D)``."""
        lay, cache = self.layers[i], runner.cache
        k_cache, v_cache, k_scale, v_scale = cache.layer(i)
        return rope_paged_attention(q, k, v, cos, sin, k_cache, v_cache, runner.meta, lay.scale, lay.window,
                                    lay.softcap, k_scale, v_scale, cache.split_counters)

    def body(self, runner, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers: ``input_ids, positions (T,)`` -> ``(hidden, residual)``, both ``(T, hidden size)``, whose sum
        the final norm takes (:meth:`head`). :mod:`llmplug.engine.packed_graphs` captures it alone, the head running
        eagerly on the rows that want logits."""
        spec, aux_layers, aux = self.spec, runner.aux_layers, {}
        hidden = self.base.embed_tokens(input_ids)
        rope = self._rotary(hidden, positions, runner)
        t, d = input_ids.shape[0], self.head_dim
        residual, producer, x = None, None, hidden  # a layer's input is producer.matmul(x), or x with no producer
        for i, lay in enumerate(self.layers):
            layer, attn = lay.module, lay.module.self_attn
            if residual is None:
                residual, qkv = hidden, lay.qkv.matmul(self._norm(hidden, layer.input_layernorm))
            else:
                qkv, residual = self._add_norm_matmul(lay.qkv, producer, x, residual, layer.input_layernorm)
            if i in aux_layers:
                aux[i] = residual
            q = qkv[:, :lay.q_size].view(t, -1, d)
            k = qkv[:, lay.q_size:lay.q_size + lay.kv_size].view(t, -1, d)
            v = qkv[:, lay.q_size + lay.kv_size:].view(t, -1, d)
            if hasattr(attn, "q_norm"):
                q, k = self._norm(q, attn.q_norm), self._norm(k, attn.k_norm)
            cos, sin = rope[lay.rope_key]
            o = self.attention(runner, i, q, k, v, cos, sin)
            if spec.sandwich_norms:  # the norm after each sublayer comes before the residual add
                hidden = self._norm(lay.o.matmul(o.view(t, -1)), layer.post_attention_layernorm)
                gated, residual = self._add_norm_matmul(lay.gate_up, None, hidden, residual,
                                                        layer.pre_feedforward_layernorm, self.activation)
                producer, x = None, self._norm(lay.down.matmul(gated), layer.post_feedforward_layernorm)
            else:
                gated, residual = self._add_norm_matmul(lay.gate_up, lay.o, o.view(t, -1), residual,
                                                        layer.post_attention_layernorm, self.activation)
                producer, x = lay.down, gated
        if aux_layers:
            runner.aux_hidden = torch.cat([aux[i] for i in aux_layers], dim=-1)
        return (x if producer is None else producer.matmul(x)), residual

    def head(self, hidden: torch.Tensor, residual: torch.Tensor, logits_indices: torch.Tensor | None) -> torch.Tensor:
        """The final residual add + norm and the lm_head on rows ``logits_indices`` (all if None) of :meth:`body`'s
        ``(hidden, residual)`` -> logits ``(R, V)``."""
        if logits_indices is not None:
            hidden, residual = hidden[logits_indices], residual[logits_indices]
        logits, _ = self._add_norm_matmul(self.lm_head, None, hidden, residual, self.base.norm)
        if self.tp is not None:  # each rank's vocabulary rows, side by side, the padding cut
            logits = self.tp.all_gather(logits)[:, :self.vocab]
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
