"""EAGLE-3 draft heads (Li et al., 2025) from a local directory in the reference format, and their proposer.

A head is one Llama decoder layer over two inputs. For a verified position ``p`` they are the embedding of token
``p + 1`` and a *feature*: ``fc`` over the target's hidden states at three layers, concatenated. Those states are
the inputs of layers ``2, L // 2, L - 3`` of an ``L``-layer target (HF's ``output_hidden_states`` entries at those
indices). From them the head predicts token ``p + 2``, at RoPE position ``p``. Each further draft is one more
position: the drafted token's embedding and the head's own output (its hidden state before the final norm) as the
feature. q, k and v read ``[input_layernorm(embedding), hidden_norm(feature)]`` (``2 H`` wide); the feature is the
attention's residual. The output layer covers a draft vocabulary: draft id ``i`` is target id ``i + d2t[i]``.

A checkpoint directory (SafeAILab's EAGLE-3 format, as vLLM's and SGLang's ``llama_eagle3`` read it) holds
``config.json`` and ``model.safetensors``. The config is a ``LlamaConfig`` dict (``vocab_size`` is the target's;
``draft_vocab_size``; optional ``target_hidden_size``). The tensors are ``fc.weight (H, 3 Ht)``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
``lm_head.weight (Vd, H)``, ``d2t (Vd,) int64`` and ``t2d (V,) bool``. An optional ``embed_tokens.weight`` replaces
the target's input embedding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from ..engine.step import to_device

__all__ = ["Eagle3Head", "Eagle3Proposer", "default_aux_layers", "load_eagle3"]

_UNSUPPORTED = ("eagle_aux_hidden_state_layer_ids", "norm_before_residual")  # config keys this reader does not honour
_KV_CHUNK = 256  # the proposer's KV grows in steps of this many positions


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs EAGLE-3 fuses: ``(2, L // 2, L - 3)``."""
    if num_layers < 3:
        raise ValueError(f"EAGLE-3 reads the inputs of layers (2, L // 2, L - 3); the model has only {num_layers} "
                         "layers (at least 3 needed)")
    return 2, num_layers // 2, num_layers - 3


class Eagle3Head(nn.Module):
    """The head's weights and dense forward (fp32 or bf16). Module names follow the checkpoint's tensor names.

    Args:
        config: the head's ``LlamaConfig`` (``hidden_size`` H, heads, ``head_dim`` D, ``intermediate_size``,
            ``rms_norm_eps``, RoPE, ``vocab_size`` V, ``draft_vocab_size`` Vd, optional ``target_hidden_size`` Ht).
        own_embedding: the checkpoint has its own ``embed_tokens`` (V, H).
    """

    def __init__(self, config: LlamaConfig, own_embedding: bool = False) -> None:
        super().__init__()
        self.config = config
        hidden, dim = config.hidden_size, config.head_dim
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        bias = bool(getattr(config, "attention_bias", False))
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = nn.ModuleDict(dict(
            input_layernorm=LlamaRMSNorm(hidden, config.rms_norm_eps),
            hidden_norm=LlamaRMSNorm(hidden, config.rms_norm_eps),
            post_attention_layernorm=LlamaRMSNorm(hidden, config.rms_norm_eps),
            self_attn=nn.ModuleDict(dict(
                q_proj=nn.Linear(2 * hidden, config.num_attention_heads * dim, bias=bias),
                k_proj=nn.Linear(2 * hidden, config.num_key_value_heads * dim, bias=bias),
                v_proj=nn.Linear(2 * hidden, config.num_key_value_heads * dim, bias=bias),
                o_proj=nn.Linear(config.num_attention_heads * dim, hidden, bias=bias),
            )),
            mlp=LlamaMLP(config),
        ))
        self.norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embedding else None
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self._inv_freq = self.rotary_emb.inv_freq.clone()

    def _apply(self, fn, recurse=True):
        """As ``nn.Module._apply``, but the RoPE frequencies stay fp32 whatever dtype the weights move to (as in a
        model ``from_pretrained`` loads in bf16)."""
        super()._apply(fn, recurse)
        self.rotary_emb.inv_freq = self._inv_freq.to(self.rotary_emb.inv_freq.device)
        return self

    def attention_inputs(self, embeds: torch.Tensor, features: torch.Tensor,
                         positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``embeds, features (R, N, H)``, ``positions (R, N)`` -> rotated ``q (R, Hq, N, D)``, ``k, v (R, Hkv, N,
        D)``."""
        layer, dim = self.midlayer, self.config.head_dim
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(features)], dim=-1)
        rows, n = x.shape[:2]
        attn = layer.self_attn
        q, k, v = (proj(x).view(rows, n, -1, dim).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        cos, sin = self.rotary_emb(x, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attention_output(self, features: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer after attention: ``features (R, N, H)`` (the residual), ``attended (R, Hq, N, D)`` -> hidden
        ``(R, N, H)`` before the final norm (the next draft's feature)."""
        layer = self.midlayer
        hidden = features + layer.self_attn.o_proj(attended.transpose(1, 2).flatten(2))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache: HeadCache,
                rows: torch.Tensor | None, span: int) -> torch.Tensor:
        """One step over ``N`` positions of ``R`` rows, keeping their keys and values in ``cache``.

        Args:
            embeds, features: ``(R, N, H)`` token embeddings and features.
            positions: ``(R, N)`` int64, each query's position, which is also its slot in ``cache``. A query attends
                to the slots ``<=`` its position, so the caller keeps slots below a row's positions valid.
            cache: the rows' keys and values.
            rows: ``(R,)`` the cache rows, or None for all of them in order.
            span: ``max(positions) + 1`` (a host int).

        Returns:
            ``(R, N, H)`` hidden states before the final norm.
        """
        q, k, v = self.attention_inputs(embeds, features, positions)
        keys, values = cache.update(rows, positions, k, v, span)
        visible = torch.arange(span, device=positions.device) <= positions[:, :, None]
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None], enable_gqa=True)
        return self.attention_output(features, attended)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` -> draft-vocabulary logits ``(..., Vd)``."""
        return self.lm_head(self.norm(hidden))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids."""
        return draft_ids + self.d2t[draft_ids]


class HeadCache:
    """The head's keys and values, dense per row: ``(B, S, Hkv, D)`` each, slot = position; grown on demand."""

    def __init__(self, head: Eagle3Head) -> None:
        param = head.fc.weight
        self.device, self.dtype = param.device, param.dtype
        self.heads, self.dim = head.config.num_key_value_heads, head.config.head_dim
        self.k = self.v = torch.empty(0, 0, self.heads, self.dim, dtype=self.dtype, device=self.device)

    def reserve(self, rows: int, length: int) -> None:
        """Room for ``rows`` rows of ``length`` slots (what is stored stays)."""
        have_rows, have_len = self.k.shape[:2]
        if rows <= have_rows and length <= have_len:
            return
        length = max(have_len, -(-length // _KV_CHUNK) * _KV_CHUNK)
        grown = []
        for old in (self.k, self.v):
            new = old.new_zeros(max(rows, have_rows), length, self.heads, self.dim)
            new[:have_rows, :have_len] = old
            grown.append(new)
        self.k, self.v = grown

    def update(self, rows: torch.Tensor | None, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v (R, Hkv, N, D)`` at ``positions (R, N)`` of ``rows`` (None: all, in order) -> the rows' keys
        and values ``(R, Hkv, span, D)``."""
        index = rows if rows is not None else torch.arange(k.shape[0], device=k.device)
        self.k[index[:, None], positions] = k.transpose(1, 2)
        self.v[index[:, None], positions] = v.transpose(1, 2)
        if rows is None:
            return self.k[:, :span].transpose(1, 2), self.v[:, :span].transpose(1, 2)
        return self.k[rows, :span].transpose(1, 2), self.v[rows, :span].transpose(1, 2)


class Eagle3Proposer:
    """Drafts for ``generate(..., assistant_model=proposer)`` from an EAGLE-3 head, greedy over its draft vocabulary.

    The decode loop turns on the target's capture of ``aux_layers`` (:meth:`ModelRunner.capture_aux`) and hands the
    proposer the captured states of every position it verifies (:meth:`observe`): the prompt after prefill, then
    each verify step's accepted positions. Proposing first runs the head over the positions observed since the last
    proposal, which also gives the first draft, then ``k - 1`` steps on its own features. The draft positions' keys
    and values are never kept: the next proposal overwrites their slots with the verified positions'.

    One object serves any number of ``generate`` calls; :meth:`release` (called when a call ends) drops a call's
    state.

    Args:
        head: the loaded head.
        embed: the token embedding the head reads (``head.embed_tokens`` or the target's input embedding).
        aux_layers: the target layers whose inputs the head fuses.
    """

    def __init__(self, head: Eagle3Head, embed: nn.Module, aux_layers: tuple[int, ...]) -> None:
        self.head, self.embed, self.aux_layers = head, embed, aux_layers
        self.release()

    def release(self) -> None:
        """Forget the call's rows (their features and the head's keys and values)."""
        self._cache: HeadCache | None = None
        self._done: dict[int, int] = {}  # per row: positions whose verified features the head's KV holds
        self._pending: dict[int, list[torch.Tensor]] = {}  # per row: features observed since, (n, H) each

    def forget(self, row: int) -> None:
        """Drop one row's state (the Engine's sequence that held it is gone); its slot starts afresh at position 0."""
        self._done.pop(row, None)
        self._pending.pop(row, None)

    @torch.inference_mode()
    def observe(self, rows: list[int], aux: list[torch.Tensor]) -> None:
        """The target's states of each row's next verified positions: ``aux[i] (n_i, 3 Ht)`` for row ``rows[i]`` (read
        now; the runner reuses its buffers)."""
        fc = self.head.fc
        features = fc(torch.cat(aux).to(fc.weight.dtype)).split([a.shape[0] for a in aux])
        for r, piece in zip(rows, features):
            self._pending.setdefault(r, []).append(piece)

    @torch.inference_mode()
    def propose(self, rows: list[int], histories: list[list[int]], k: int) -> list[list[int]]:
        """``k`` greedy drafts for each of ``rows`` (indices into ``histories``, each row's tokens so far)."""
        head, count = self.head, len(rows)
        done = [self._done.get(r, 0) for r in rows]
        new = [sum(p.shape[0] for p in self._pending.get(r, [])) for r in rows]
        for r, d, n in zip(rows, done, new):
            if n == 0 or d + n != len(histories[r]) - 1:
                raise RuntimeError(f"EAGLE-3 proposer: row {r} has target states for {d + n} positions but "
                                   f"{len(histories[r])} tokens; observe() must see every verified position")
        width = max(new)
        if self._cache is None:
            self._cache = HeadCache(head)
        self._cache.reserve(max(self._pending) + 1, max(d + max(width, n + k - 1) for d, n in zip(done, new)))
        device = head.fc.weight.device
        # step 1: every new position (the tokens after them, their verified features); rows padded to ``width``
        tokens = [histories[r][d + 1:d + 1 + n] + [0] * (width - n) for r, d, n in zip(rows, done, new)]
        positions = [[d + j for j in range(width)] for d in done]
        slots = [i * width + j for i, n in enumerate(new) for j in range(n)]
        host = torch.tensor(tokens + positions, dtype=torch.long)
        tokens_dev, positions_dev = to_device(host, device).split(count)
        slots_dev, last_dev = to_device(torch.tensor(slots + [n - 1 for n in new], dtype=torch.long), device).split(
            [len(slots), count])
        flat = torch.cat([p for r in rows for p in self._pending[r]])
        features = flat.new_zeros(count * width, flat.shape[1]).index_copy_(0, slots_dev, flat).view(count, width, -1)
        index = None if rows == list(range(self._cache.k.shape[0])) else to_device(torch.tensor(rows), device)
        hidden = head(self._embed(tokens_dev), features, positions_dev, self._cache, index,
                      max(done) + width)
        hidden = hidden[torch.arange(count, device=device), last_dev]
        drafts = [head.to_target(head.logits(hidden).argmax(-1))]
        # steps 2..k: one position a row, the head's own feature and token
        position = positions_dev[:, 0] + last_dev
        top = max(d + n for d, n in zip(done, new)) - 1
        for step in range(1, k):
            hidden = head(self._embed(drafts[-1][:, None]), hidden[:, None], (position + step)[:, None], self._cache,
                          index, top + step + 1)[:, 0]
            drafts.append(head.to_target(head.logits(hidden).argmax(-1)))
        for r, d, n in zip(rows, done, new):
            self._done[r] = d + n
            self._pending[r] = []
        return torch.stack(drafts, dim=1).tolist()

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``(R, N)`` -> embeddings ``(R, N, H)`` where and in the dtype the head runs."""
        weight = self.head.fc.weight
        return self.embed(ids.to(self.embed.weight.device)).to(device=weight.device, dtype=weight.dtype)


def load_eagle3(path: str | Path, target_model: nn.Module, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> Eagle3Proposer:
    """Load an EAGLE-3 head from a local directory for ``target_model``; pass the result as ``assistant_model``.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (never a pickle, never remote code).
        target_model: the HF causal LM the head drafts for.
        device, dtype: where the head runs; default the target's.

    Raises:
        FileNotFoundError: the directory or one of its files is missing.
        ValueError: the head does not fit the target (hidden size, vocabulary, layer count) or its tensors do not
            fit its config (each message names the value found and the one expected).
    """
    path = Path(path)
    files = {name: path / name for name in ("config.json", "model.safetensors")}
    for file in files.values():
        if not file.is_file():
            found = sorted(p.name for p in path.iterdir()) if path.is_dir() else "no such directory"
            raise FileNotFoundError(f"EAGLE-3 head: {file} is missing (the directory needs config.json and "
                                    f"model.safetensors; found: {found})")
    raw = json.loads(files["config.json"].read_text())
    unsupported = [key for key in _UNSUPPORTED if raw.get(key) or (raw.get("eagle_config") or {}).get(key)]
    if unsupported:
        raise ValueError(f"EAGLE-3 head {path}: config sets {unsupported}, which llmplug does not support (it reads "
                         "the reference format: the inputs of layers (2, L // 2, L - 3), the feature as residual)")
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"EAGLE-3 head {path}: num_hidden_layers={raw['num_hidden_layers']}, expected 1")
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "auto_map")})
    tensors = load_file(files["model.safetensors"])
    head = Eagle3Head(config, own_embedding="embed_tokens.weight" in tensors)
    _check_tensors(path, head, tensors)
    head.load_state_dict(tensors)
    text = target_model.config.get_text_config()
    embed = head.embed_tokens if head.embed_tokens is not None else target_model.get_input_embeddings()
    _check_target(path, head, text, embed)
    param = next(target_model.parameters())
    head.to(device=device or param.device, dtype=dtype or param.dtype).eval()
    return Eagle3Proposer(head, embed, default_aux_layers(text.num_hidden_layers))


def _check_tensors(path: Path, head: Eagle3Head, tensors: dict[str, torch.Tensor]) -> None:
    expected = head.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"EAGLE-3 head {path}: model.safetensors lacks {missing} and has unexpected {unexpected}")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"EAGLE-3 head {path}: {name} has shape {tuple(tensor.shape)}, config.json implies "
                             f"{tuple(expected[name].shape)}")


def _check_target(path: Path, head: Eagle3Head, text, embed: nn.Module) -> None:
    config = head.config
    fused = head.fc.in_features // 3
    if text.hidden_size != fused:
        raise ValueError(f"EAGLE-3 head {path} fuses target states of width {fused} (fc.weight is "
                         f"{tuple(head.fc.weight.shape)}) but the model's hidden_size is {text.hidden_size}")
    vocab = embed.weight.shape[0]
    if config.vocab_size != vocab:
        raise ValueError(f"EAGLE-3 head {path} has vocab_size={config.vocab_size} but the model embeds {vocab} "
                         "tokens: the head must be trained for this model's tokenizer")
    if embed.weight.shape[1] != config.hidden_size:
        raise ValueError(f"EAGLE-3 head {path} has hidden_size={config.hidden_size} but reads the model's input "
                         f"embedding of width {embed.weight.shape[1]} (a head of another width needs its own "
                         "embed_tokens.weight)")
    targets = torch.arange(head.d2t.numel()) + head.d2t
    if targets.min() < 0 or targets.max() >= vocab:
        raise ValueError(f"EAGLE-3 head {path}: d2t maps draft ids to target ids {int(targets.min())}.."
                         f"{int(targets.max())}, outside the model's vocabulary of {vocab}")
    default_aux_layers(text.num_hidden_layers)
