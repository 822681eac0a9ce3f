"""The fused forward shared by the Llama-like families (llama, mistral, qwen2, qwen3, gemma*, phi3).

Per layer: fused residual-add + RMSNorm, one q/k/v GEMM, per-head q/k RMSNorm where the family has it, RoPE in
place, paged attention, one gate/up GEMM, gated activation. The HF modules keep their weights (the fused q/k/v
and gate/up weights are views shared with them), so the stock HF forward keeps working beside this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..engine.attention import paged_attention
from ..ops.act_mul import act_and_mul
from ..ops.gemv import gemv
from ..ops.rms_norm import add_rms_norm, rms_norm
from ..ops.rope_store_kv import rope_store_kv
from .undo import UndoLog


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


@dataclass
class _Layer:
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    gate_up_w: torch.Tensor
    q_size: int
    kv_size: int
    scale: float
    window: int | None
    softcap: float | None
    rope_key: str | None
    module: torch.nn.Module = field(repr=False)


def _eps(norm: torch.nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _fuse_attention(attn: torch.nn.Module, log: UndoLog) -> tuple[torch.Tensor, torch.Tensor | None]:
    if hasattr(attn, "qkv_proj"):  # Phi-3 ships it fused
        return attn.qkv_proj.weight, attn.qkv_proj.bias
    projs = [attn.q_proj, attn.k_proj, attn.v_proj]
    weight = log.fuse_parameters([p.weight for p in projs])
    bias = log.fuse_parameters([p.bias for p in projs]) if projs[0].bias is not None else None
    return weight, bias


def _fuse_mlp(mlp: torch.nn.Module, log: UndoLog) -> torch.Tensor:
    if hasattr(mlp, "gate_up_proj"):  # Phi-3
        return mlp.gate_up_proj.weight
    if mlp.gate_proj.bias is not None:
        raise NotImplementedError("MLP biases are not fused")
    return log.fuse_parameters([mlp.gate_proj.weight, mlp.up_proj.weight])


class FusedDecoder:
    """Prepared (fused) weights of one model plus its forward over flat token lists."""

    def __init__(self, model: torch.nn.Module, spec: FamilySpec, activation: str, log: UndoLog) -> None:
        self.spec = spec
        self.activation = activation
        self.base = model.model
        self.lm_head = model.lm_head
        text = model.config.get_text_config()
        self.final_softcap = getattr(text, "final_logit_softcapping", None)
        self.layers = []
        for layer in self.base.layers:
            attn = layer.self_attn
            qkv_w, qkv_b = _fuse_attention(attn, log)
            head_dim = attn.head_dim
            n_heads = getattr(attn, "num_heads", None) or text.num_attention_heads
            n_kv = getattr(attn, "num_key_value_heads", None) or text.num_key_value_heads
            window = getattr(text, "sliding_window", None) if spec.window_from_config else \
                getattr(attn, "sliding_window", None)
            self.layers.append(_Layer(
                qkv_w=qkv_w, qkv_b=qkv_b, gate_up_w=_fuse_mlp(layer.mlp, log),
                q_size=n_heads * head_dim, kv_size=n_kv * head_dim, scale=float(attn.scaling),
                window=window, softcap=getattr(attn, "attn_logit_softcapping", None),
                rope_key=getattr(attn, "layer_type", None) if spec.rope_per_layer_type else None, module=layer,
            ))
        self.head_dim = self.base.layers[0].self_attn.head_dim

    @staticmethod
    def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                activation: str = "") -> torch.Tensor:
        """``x @ W^T (+ b)``, with ``act(gate) * up`` applied to ``x`` first when ``activation`` is given.

        One token on CUDA (batch-1 decode) goes through llmplug's GEMV, which reads the weight at a higher rate
        than cuBLAS's small-N kernels and fuses the activation; everything else through ``F.linear``.
        """
        if x.shape[0] == 1 and x.is_cuda:
            return gemv(x, weight, bias, activation)
        if activation:
            x = act_and_mul(x, activation)
        return F.linear(x, weight, bias)

    def _norm(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        return rms_norm(x, norm.weight, _eps(norm), self.spec.norm_offset)

    def _add_norm(self, x, residual, norm):
        return add_rms_norm(x, residual, norm.weight, _eps(norm), self.spec.norm_offset)

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str | None, tuple]:
        pos = positions[None]
        if self.spec.rope_per_layer_type:
            keys = {layer.rope_key for layer in self.layers}
            embs = {k: self.base.rotary_emb(hidden, pos, k) for k in keys}
        else:
            embs = {None: self.base.rotary_emb(hidden, pos)}
        return {k: (cos[0], sin[0]) for k, (cos, sin) in embs.items()}

    def __call__(self, runner, input_ids: torch.Tensor, positions: torch.Tensor,
                 logits_indices: torch.Tensor | None) -> torch.Tensor:
        """``input_ids, positions: (T,)`` -> logits ``(B, V)`` for rows ``logits_indices`` (all rows if None)."""
        spec, cache, meta = self.spec, runner.cache, runner.meta
        hidden = self.base.embed_tokens(input_ids)
        rope = self._rotary(hidden, positions)
        t, d = input_ids.shape[0], self.head_dim
        residual = None
        for i, lay in enumerate(self.layers):
            layer, attn = lay.module, lay.module.self_attn
            if residual is None:
                residual, x = hidden, self._norm(hidden, layer.input_layernorm)
            else:
                x, residual = self._add_norm(hidden, residual, layer.input_layernorm)
            qkv = self._linear(x, lay.qkv_w, lay.qkv_b)
            q = qkv[:, :lay.q_size].view(t, -1, d)
            k = qkv[:, lay.q_size:lay.q_size + lay.kv_size].view(t, -1, d)
            v = qkv[:, lay.q_size + lay.kv_size:].view(t, -1, d)
            if hasattr(attn, "q_norm"):
                q, k = self._norm(q, attn.q_norm), self._norm(k, attn.k_norm)
            cos, sin = rope[lay.rope_key]
            k_cache, v_cache = cache.layer(i)
            rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
            o = paged_attention(q, k, v, k_cache, v_cache, meta, lay.scale, lay.window, lay.softcap, stored=True)
            hidden = self._linear(o.view(t, -1), attn.o_proj.weight, attn.o_proj.bias)
            if spec.sandwich_norms:
                hidden = self._norm(hidden, layer.post_attention_layernorm)
                x, residual = self._add_norm(hidden, residual, layer.pre_feedforward_layernorm)
            else:
                x, residual = self._add_norm(hidden, residual, layer.post_attention_layernorm)
            down = layer.mlp.down_proj
            hidden = self._linear(self._linear(x, lay.gate_up_w), down.weight, down.bias, self.activation)
            if spec.sandwich_norms:
                hidden = self._norm(hidden, layer.post_feedforward_layernorm)
        if logits_indices is not None:
            hidden, residual = hidden[logits_indices], residual[logits_indices]
        hidden, _ = self._add_norm(hidden, residual, self.base.norm)
        logits = self._linear(hidden, self.lm_head.weight, self.lm_head.bias)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
