"""Fold a decode step's RoPE and static-cache store into its attention: ``llmplug::dense_decode_attention`` (from
:mod:`llmplug.inductor.attention`) over caches HF has just written becomes ``llmplug::rope_dense_decode_attention``.

In the post-grad graph of a compiled HF decode step, a layer does ``q_rot = q * cos + rotate_half(q) * sin`` (the same
for ``k``), writes the caches functionally (``index_put(k_cache, [None, None, position], k_rot)``, or ``index_copy``
along dim 2, and the same for ``v``), attends over the written caches and copies them back into the graph's inputs
(``copy_(k_cache, written)``). Each match becomes one call of the fused op through ``auto_functionalized``, which
Inductor turns back into the op writing the caches in place (its copy-back then goes away). Matched: RoPE over all
of the head dim (HF's ``rotate_half``), one position for every sequence, caches that are graph inputs written only
here, on a device in :data:`~llmplug.inductor.attention.DEVICES`.
"""

from __future__ import annotations

import operator

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from ..ops import rope_dense_decode_attention as _op  # noqa: F401 - registers llmplug::rope_dense_decode_attention
from .nodes import call, fake_value, is_call, is_view, value

aten = torch.ops.aten

def _dim(node, d: int) -> int:
    return d % value(node).dim()


def _rotate_half(node) -> torch.fx.Node | None:
    """``x`` where ``node`` is ``cat([-x[..., h:], x[..., :h]], -1)`` with ``h`` half the last dim."""
    if not is_call(node, aten.cat.default) or len(node.args[0]) != 2:
        return None
    neg, low = node.args[0]
    if not is_call(neg, aten.neg.default) or _dim(node, node.args[1] if len(node.args) > 1 else 0) != \
            value(node).dim() - 1:
        return None
    high = neg.args[0]
    if not (is_call(high, aten.slice.Tensor) and is_call(low, aten.slice.Tensor)) or high.args[0] is not low.args[0]:
        return None
    x = high.args[0]
    half = value(x).shape[-1] // 2
    last = value(x).dim() - 1
    if value(x).shape[-1] % 2 or _dim(x, high.args[1]) != last or _dim(x, low.args[1]) != last:
        return None
    if high.args[2] != half or high.args[3] < 2 * half or tuple(low.args[2:4]) != (0, half):
        return None
    return x


def _products(node) -> list[tuple]:
    """``[(a, b), (b, a)]`` for a ``mul(a, b)`` node, else ``[]``."""
    if not is_call(node, aten.mul.Tensor) or not all(isinstance(a, torch.fx.Node) for a in node.args[:2]):
        return []
    return [tuple(node.args[:2]), tuple(node.args[1::-1])]


def rope(node) -> tuple | None:
    """``(x, cos, sin)`` where ``node`` is HF's ``x * cos + rotate_half(x) * sin`` of ``x: (B, heads, 1, D)`` with
    ``cos, sin: (B or 1, 1, 1, D)``, else None."""
    if not is_call(node, aten.add.Tensor) or len(node.args) != 2:
        return None
    for first, second in (node.args, node.args[::-1]):
        for x, cos in _products(first):
            for rotated, sin in _products(second):
                xv, cv, sv = value(x), value(cos), value(sin)
                if _rotate_half(rotated) is not x or xv is None or xv.dim() != 4 or xv.shape[2] != 1:
                    continue
                want = (1, 1, xv.shape[3])
                if all(t is not None and t.dim() == 4 and tuple(t.shape[1:]) == want and t.shape[0] in (1, xv.shape[0])
                       and t.dtype == xv.dtype for t in (cv, sv)):
                    return x, cos, sin
    return None


def _store(node) -> tuple | None:
    """``(cache, position, written)`` where ``node`` writes ``written (B, Hkv, 1, D)`` into graph input ``cache
    (B, Hkv, L, D)`` at ``position (1,)`` along dim 2, functionally, else None."""
    if is_call(node, aten.index_put.default) and node.args[3:] in ((), (False,)):
        cache, index, written = node.args[:3]
        if len(index) != 3 or index[0] is not None or index[1] is not None:
            return None
        position = index[2]
    elif is_call(node, aten.index_copy.default) and _dim(node, node.args[1]) == 2:
        cache, _, position, written = node.args
    else:
        return None
    pv, cv, wv = value(position), value(cache), value(written)
    if not isinstance(cache, torch.fx.Node) or cache.op != "placeholder" or pv is None or tuple(pv.shape) != (1,) \
            or pv.dtype != torch.int64 or cv is None or wv is None or cv.dim() != 4 or \
            tuple(wv.shape) != (cv.shape[0], cv.shape[1], 1, cv.shape[3]):
        return None
    return cache, position, written


def _written_back(node, cache) -> torch.fx.Node | None:
    """The ``copy_(cache, node)`` that writes ``node`` back into the graph input, where that and the attention are
    ``node``'s only users; else None."""
    copies = [u for u in node.users if is_call(u, aten.copy_.default) and u.args[0] is cache and u.args[1] is node]
    attends = [u for u in node.users if is_call(u, torch.ops.llmplug.dense_decode_attention.default)]
    return copies[0] if len(copies) == 1 and len(attends) == 1 and len(node.users) == 2 else None


def match(node) -> dict | None:
    """A ``dense_decode_attention`` node over caches the graph has just written, its q and new key rotated by the
    same RoPE rows -> the fused op's arguments and the nodes it replaces, else None."""
    if not is_call(node, torch.ops.llmplug.dense_decode_attention.default):
        return None
    q3, k_written, v_written, mask, scale = node.args
    k_store, v_store = _store(k_written), _store(v_written)
    if not is_view(q3) or k_store is None or v_store is None or k_store[1] is not v_store[1]:
        return None
    q_rope, k_rope = rope(q3.args[0]), rope(k_store[2])
    if q_rope is None or k_rope is None or q_rope[1:] != k_rope[1:]:
        return None
    copies = _written_back(k_written, k_store[0]), _written_back(v_written, v_store[0])
    if None in copies or value(k_store[0]).stride() != value(v_store[0]).stride():
        return None
    return {"q": q_rope[0], "k": k_rope[0], "v": v_store[2], "cos": q_rope[1], "sin": q_rope[2],
            "k_cache": k_store[0], "v_cache": v_store[0], "position": k_store[1], "mask": mask, "scale": scale,
            "copies": copies}


def replace(graph: torch.fx.Graph) -> int:
    """Fold every matching RoPE + cache store into its ``dense_decode_attention``; returns how many."""
    op = torch.ops.llmplug.rope_dense_decode_attention.default
    count = 0
    for node in list(graph.nodes):
        found = match(node)
        if found is None:
            continue
        bsz, heads, dim = value(node).shape
        kv_heads = value(found["k_cache"]).shape[1]
        with graph.inserting_before(node):
            q = call(graph, aten.reshape.default, found["q"], [bsz, heads, dim])
            k, v = (call(graph, aten.reshape.default, found[n], [bsz, kv_heads, dim]) for n in ("k", "v"))
            rows = []
            for name in ("cos", "sin"):
                row = call(graph, aten.reshape.default, found[name], [value(found[name]).shape[0], dim])
                rows.append(row if value(row).shape[0] == bsz else call(graph, aten.expand.default, row, [bsz, dim]))
            kwargs = dict(q=q, k=k, v=v, cos=rows[0], sin=rows[1], k_cache=found["k_cache"],
                          v_cache=found["v_cache"], position=found["position"], key_mask=found["mask"],
                          scale=found["scale"])
            fused = graph.call_function(auto_functionalized, (op,), kwargs)
            fused.meta["val"] = (value(node), fake_value(aten.clone.default, found["k_cache"]),
                                 fake_value(aten.clone.default, found["v_cache"]))
            outs = []
            for i in range(3):
                outs.append(graph.call_function(operator.getitem, (fused, i)))
                outs[-1].meta["val"] = fused.meta["val"][i]
        node.replace_all_uses_with(outs[0])
        for copy, written in zip(found["copies"], outs[1:], strict=True):
            copy.args = (copy.args[0], written)
        count += 1
    graph.eliminate_dead_code()
    return count

