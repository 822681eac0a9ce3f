"""Split an HF decoder's weights over a tensor-parallel group, in place, and back (bit-identical).

Each rank keeps (Megatron's layout, as gpt-fast applies it in place):

* q/k/v projections by heads (column-parallel); GQA KV heads split when the group size divides them, else each rank
  keeps the one KV head its query heads read (replicated over ``size / num_kv_heads`` ranks);
* ``o_proj`` and ``down_proj`` by input columns (row-parallel: each rank's output is a partial sum, all-reduced; a
  bias is added by rank 0 alone);
* ``gate_proj`` and ``up_proj`` by output rows, the same rows of each, so the gated activation stays local;
* the embedding and the LM head by vocabulary rows, ``ceil(V / size)`` a rank (the last padded with zero rows): the
  embedding's lookup is masked to the rank's rows and all-reduced, the LM head's logits gathered.

The HF modules keep working: forward hooks all-reduce the row-parallel projections' outputs and gather the LM head's
logits, the embedding's forward is replaced. Undo gathers every slice back from the ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..patches.undo import UndoLog
from ..quant.linear import QuantLinear
from .group import TPGroup
from .sources import InPlace

_COLUMN = ("q_proj", "k_proj", "v_proj")
_MLP_COLUMN = ("gate_proj", "up_proj")


def head_split(num_heads: int, num_kv_heads: int, size: int) -> tuple[int, int]:
    """(query heads, KV heads) each of ``size`` ranks holds; ValueError where the heads do not split."""
    if num_heads % size:
        raise ValueError(f"tensor_parallel={size} must divide the model's {num_heads} attention heads")
    if num_kv_heads % size == 0:
        return num_heads // size, num_kv_heads // size
    if size % num_kv_heads == 0:
        return num_heads // size, 1
    raise ValueError(f"tensor_parallel={size} must divide the model's {num_kv_heads} KV heads or be a multiple of them")


def kv_heads_of(rank: int, num_heads: int, num_kv_heads: int, size: int) -> range:
    """The KV heads rank ``rank`` holds: those its query heads read."""
    q, kv = head_split(num_heads, num_kv_heads, size)
    first = rank * q // (num_heads // num_kv_heads)
    return range(first, first + kv)


Ranges = list[tuple[int, int]]  # per rank, the [start, stop) of a dimension it keeps


class _Split:
    """One split in progress: the group, the undo log, where slices come from."""

    def __init__(self, tp: TPGroup, log: UndoLog, source) -> None:
        self.tp, self.log, self.source = tp, log, source

    def take(self, owner: torch.nn.Module, name: str, dim: int, ranges: Ranges) -> None:
        """Keep ``owner.name``'s range ``ranges[rank]`` along ``dim`` (equal lengths on every rank); undo gathers
        them."""
        tp = self.tp
        full_shape = getattr(owner, name).shape
        _put(owner, name, self.source.part(owner, name, dim, *ranges[tp.rank]))

        def undo() -> None:
            parts = tp.stack(getattr(owner, name).data)
            full = torch.empty(full_shape, dtype=parts.dtype, device=parts.device)
            for rank, (start, stop) in enumerate(ranges):
                full.narrow(dim, start, stop - start).copy_(parts[rank])
            _put(owner, name, full)

        self.log.record(undo)

    def only_rank0(self, owner: torch.nn.Module, name: str) -> None:
        """A row-parallel bias: added once, by rank 0 (zeros elsewhere); undo gives each rank its own again."""
        t = getattr(owner, name)
        if t is None or self.tp.rank == 0:
            return
        old = t.data
        _put(owner, name, torch.zeros(t.shape, dtype=t.dtype, device=self.source.device))
        self.log.record(lambda: _put(owner, name, old))


def _put(owner: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """``owner.name = value``: a parameter keeps its object (a new one where it was on the meta device), a buffer is
    set anew."""
    t = getattr(owner, name)
    if isinstance(t, torch.nn.Parameter) and not t.is_meta and not value.is_meta:
        t.data = value
    elif isinstance(t, torch.nn.Parameter):
        setattr(owner, name, torch.nn.Parameter(value, requires_grad=False))
    else:
        setattr(owner, name, value)


def _heads(heads: range, head_dim: int) -> tuple[int, int]:
    return heads.start * head_dim, heads.stop * head_dim


def _check_linear(module: torch.nn.Module, name: str) -> torch.nn.Module:
    if type(module) is torch.nn.Linear:
        return module
    if isinstance(module, QuantLinear) and module.perm is None:
        return module
    raise NotImplementedError(f"tensor parallelism splits nn.Linear and llmplug's quantized linears; {name} is "
                              f"{type(module).__name__}" + (" with act-order input permutation"
                                                            if isinstance(module, QuantLinear) else ""))


def _split_rows(split: _Split, lin: torch.nn.Module, rows: Ranges) -> None:
    """Column-parallel: keep output rows ``rows[rank]`` of a linear (quantized: its weights, scales, zeros)."""
    names = ["weight"] if type(lin) is torch.nn.Linear else [n for n in ("qweight", "scales", "zeros")
                                                             if getattr(lin, n, None) is not None]
    for name in names + (["bias"] if lin.bias is not None else []):
        split.take(lin, name, 0, rows)
    start, stop = rows[split.tp.rank]
    split.log.set_attr(lin, "out_features", stop - start)


def _split_columns(split: _Split, lin: torch.nn.Module, cols: Ranges) -> None:
    """Row-parallel: keep input columns ``cols[rank]``; the bias is rank 0's alone. An int4 linear's ranges must hold
    whole groups: its packed bytes and group scales split with them."""
    if type(lin) is torch.nn.Linear or lin.method != "int4":
        split.take(lin, "weight" if type(lin) is torch.nn.Linear else "qweight", 1, cols)
    else:
        group = lin.group_size
        width = cols[0][1] - cols[0][0]
        if width % group:
            raise ValueError(f"tensor_parallel={split.tp.size} splits {lin.in_features} int4 input features into "
                             f"{width} a rank, not whole groups of {group}: quantize with a group size that divides "
                             "them")
        split.take(lin, "qweight", 1, [(a // 2, b // 2) for a, b in cols])
        for name in ("scales", "zeros"):
            split.take(lin, name, 1, [(a // group, b // group) for a, b in cols])
    if lin.bias is not None:
        split.only_rank0(lin, "bias")
    start, stop = cols[split.tp.rank]
    split.log.set_attr(lin, "in_features", stop - start)


def shard_model(model: torch.nn.Module, tp: TPGroup, log: UndoLog, source=None) -> None:
    """Split ``model``'s decoder layers, embedding and LM head over ``tp`` in place (module docstring).

    Args:
        source: where each rank's slices come from (:mod:`llmplug.parallel.sources`); None: the weights the model
            holds. A model on the meta device takes every tensor the split leaves whole from it too.
    """
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise NotImplementedError("the model was loaded with transformers' tp_plan (DTensor weights): load it plainly "
                                  "and optimize(model, tensor_parallel=...), or llmplug.load_split(path) to read only "
                                  "each rank's slices")
    text = model.config.get_text_config()
    decoder = model.get_decoder()
    param = next(model.parameters())
    split = _Split(tp, log, source if source is not None else InPlace(param.device))
    tp.prepare(split.source.device)
    n_heads, n_kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    q_local, _ = head_split(n_heads, n_kv, tp.size)
    for i, layer in enumerate(decoder.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, p) for p in (*_COLUMN, "o_proj")) \
                or not all(hasattr(mlp, p) for p in (*_MLP_COLUMN, "down_proj")):
            raise NotImplementedError(f"tensor parallelism needs decoder layers with self_attn.q/k/v/o_proj and "
                                      f"mlp.gate/up/down_proj; {type(layer).__name__} has other projections")
        d = attn.head_dim
        norm = getattr(attn, "q_norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.numel() != d:
            raise NotImplementedError(f"{type(attn).__name__} normalises q over all heads together "
                                      "(not per head): it does not split over tensor-parallel ranks")
        q_rows = [_heads(range(r * q_local, (r + 1) * q_local), d) for r in range(tp.size)]
        kv_rows = [_heads(kv_heads_of(r, n_heads, n_kv, tp.size), d) for r in range(tp.size)]
        for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            _split_rows(split, _check_linear(getattr(attn, name), f"layer {i} self_attn.{name}"), rows)
        o = _check_linear(attn.o_proj, f"layer {i} self_attn.o_proj")
        _split_columns(split, o, q_rows)
        inter = mlp.gate_proj.out_features
        if inter % tp.size:
            raise ValueError(f"tensor_parallel={tp.size} must divide the MLP's {inter} intermediate features")
        step = inter // tp.size
        mlp_rows = [(r * step, (r + 1) * step) for r in range(tp.size)]
        for name in _MLP_COLUMN:
            _split_rows(split, _check_linear(getattr(mlp, name), f"layer {i} mlp.{name}"), mlp_rows)
        down = _check_linear(mlp.down_proj, f"layer {i} mlp.down_proj")
        _split_columns(split, down, mlp_rows)
        for proj in (o, down):
            handle = proj.register_forward_hook(lambda module, args, out: tp.all_reduce(out))
            log.record(handle.remove)
    _shard_vocab(split, model, text.vocab_size)
    _fill_meta(split, model)


def vocab_rows(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """(first row, rows) of the vocabulary rank ``tp.rank`` holds, ``rows = ceil(vocab / size)`` (padded)."""
    rows = math.ceil(vocab / tp.size)
    return tp.rank * rows, rows


def _vocab_shard(split: _Split, owner: torch.nn.Module, vocab: int) -> None:
    """Keep ``owner.weight``'s vocabulary rows (zero-padded to ``ceil(V / size)``); undo gathers them."""
    tp = split.tp
    first, rows = vocab_rows(vocab, tp)
    shard = split.source.part(owner, "weight", 0, min(first, vocab), min(first + rows, vocab))
    _put(owner, "weight", F.pad(shard, (0, 0, 0, rows - shard.shape[0])).contiguous())

    def undo() -> None:
        _put(owner, "weight", tp.stack(owner.weight.data).reshape(tp.size * rows, -1)[:vocab].clone())

    split.log.record(undo)


def _shard_vocab(split: _Split, model: torch.nn.Module, vocab: int) -> None:
    tp, log = split.tp, split.log
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embed).forward is not torch.nn.Embedding.forward and not hasattr(embed, "embed_scale"):
        raise NotImplementedError(f"tensor parallelism splits nn.Embedding; the model's is {type(embed).__name__}")
    tied = head is not None and head.weight is embed.weight
    if head is not None and not tied:
        if type(head) is not torch.nn.Linear or head.bias is not None:
            raise NotImplementedError(f"tensor parallelism splits an LM head that is a plain nn.Linear without bias; "
                                      f"the model's is {head!r} (keep lm_head out of quantization)")
        _vocab_shard(split, head, vocab)
    _vocab_shard(split, embed, vocab)
    if tied and head.weight is not embed.weight:  # the split made a new parameter (a model on the meta device)
        head.weight = embed.weight
    first, rows = vocab_rows(vocab, tp)

    def embed_forward(input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - first
        inside = (local >= 0) & (local < rows)
        out = F.embedding(local.clamp(0, rows - 1), embed.weight)
        # through NCCL: a forward's first collective is a barrier, which the one-shot all-reduce's slots rely on
        out = tp.all_reduce(out.masked_fill(~inside[..., None], 0), fence=True)
        scale = getattr(embed, "embed_scale", None)  # Gemma 3's scaled embedding
        return out * scale.to(out.dtype) if scale is not None else out

    log.set_attr(embed, "forward", embed_forward)
    if head is not None:
        handle = head.register_forward_hook(lambda module, args, out: tp.all_gather(out)[..., :vocab])
        log.record(handle.remove)


def _fill_meta(split: _Split, model: torch.nn.Module) -> None:
    """Every parameter still on the meta device (left whole by the split: norms, rank 0's biases), and every meta
    buffer the source holds, read whole from the source."""
    for module in list(model.modules()):
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None and t.is_meta and (name in module._parameters or split.source.holds(module, name)):
                _put(module, name, split.source.whole(module, name))
