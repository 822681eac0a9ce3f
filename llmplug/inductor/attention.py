"""Find a decode step's attention over HF's static cache in a post-grad FX graph and call llmplug's decode attention
instead of SDPA.

A compiled HF decode step (``cache_implementation="static"``) attends one query token a sequence to the whole static
cache: ``sdpa(q (B, H, 1, D), repeat_kv(k_cache), repeat_kv(v_cache), attn_mask=where(mask, 0, -inf))``, with the
caches ``(B, Hkv, L, D)``, ``repeat_kv`` an ``unsqueeze`` + ``expand`` + ``clone`` that writes each cache ``H / Hkv``
times over a step, and the mask ``(B or 1, 1, 1, L)`` bool (SDPA's CUDA kernels take it as a bias of 0 and a large
negative number). Each match becomes ``llmplug::dense_decode_attention(q, k_cache, v_cache, mask, scale)``, which
reads the caches where they lie, once a kv head (:mod:`llmplug.ops.dense_decode_attention`). Matched: one query
token, no dropout, not causal, no output but the attention's used, a boolean mask (as is, or as such a bias) or none,
on a device in :data:`DEVICES` (CUDA: elsewhere the op is only its reference).
"""

from __future__ import annotations

import operator

import torch

from ..ops import dense_decode_attention as _op  # noqa: F401 - registers llmplug::dense_decode_attention
from .nodes import call, is_call, is_view, value

aten = torch.ops.aten
DEVICES = ("cuda",)  # where the op is a kernel of its own; tests add "cpu" to exercise the matching


def _sdpa_ops() -> tuple:
    """The fused SDPA ops a post-grad graph may hold (whichever this torch has)."""
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention")
    return tuple(getattr(aten, n).default for n in names if hasattr(aten, n))


def _arguments(node: torch.fx.Node) -> dict:
    """``node``'s arguments by their schema names, defaults filled in."""
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _unrepeated(node, shape) -> torch.fx.Node | None:
    """The ``(B, Hkv, L, D)`` cache that SDPA's key or value ``node`` of ``shape (B, H, L, D)`` is: itself (``H ==
    Hkv``), or what HF's ``repeat_kv`` expanded (``view(clone(expand(unsqueeze(cache, 2))))``); None otherwise."""
    base = node
    if is_view(base):
        base = base.args[0]
    if is_call(base, aten.clone.default):
        base = base.args[0]
    if is_call(base, aten.expand.default) and is_call(base.args[0], aten.unsqueeze.default) and \
            base.args[0].args[1] == 2:
        cache = base.args[0].args[0]
        bsz, heads, length, dim = shape
        cv = value(cache)
        if cv is not None and cv.dim() == 4 and (cv.shape[0], cv.shape[2], cv.shape[3]) == (bsz, length, dim) and \
                heads % cv.shape[1] == 0 and list(value(base).shape) == [bsz, cv.shape[1], heads // cv.shape[1],
                                                                         length, dim]:
            return cache
    return node if value(node) is not None and value(node).dim() == 4 else None


# A bias at or below this hides a key as -inf does (SDPA's CUDA kernels get a bool mask as ``where(mask, 0, -65536)``
# in bf16): ``exp`` of it underflows to 0 in fp32 for scores of any realistic size. The difference is a row with no
# visible key (SDPA averages such a row's values, llmplug's kernel gives zeros): a decode query always sees itself.
_HIDDEN = -1e4


def _scalar(node) -> float | None:
    """The number ``node`` is (a Python number or a 0-d ``full``), or None."""
    if isinstance(node, (int, float)):
        return float(node)
    if is_call(node, aten.full.default) and list(node.args[0]) == [] and isinstance(node.args[1], (int, float)):
        return float(node.args[1])
    return None


def _key_mask(mask, bsz: int, length: int):
    """``(mask node or None, ok)``: the boolean ``(b, 1, 1, L)`` mask (``b`` 1 or ``bsz``) behind SDPA's ``mask``
    argument: a bool mask or ``where(bool, 0, b)`` with ``b <= _HIDDEN`` (-inf too), through broadcasts and the
    pad-then-slice that aligns a mask's last dim for some SDPA kernels."""
    if mask is None:
        return None, True
    while True:
        if is_call(mask, aten.expand.default):
            mask = mask.args[0]
        elif is_call(mask, aten.slice.Tensor) and is_call(mask.args[0], aten.constant_pad_nd.default) and \
                value(mask).shape == value(mask.args[0].args[0]).shape:
            mask = mask.args[0].args[0]
        elif is_call(mask, aten.where.self) and _scalar(mask.args[1]) == 0.0 and \
                (_scalar(mask.args[2]) or 0.0) <= _HIDDEN:
            mask = mask.args[0]
        else:
            break
    mv = value(mask)
    ok = mv is not None and mv.dtype == torch.bool and mv.dim() == 4 and mv.shape[0] in (1, bsz) and \
        tuple(mv.shape[1:]) == (1, 1, length)
    return mask, ok


def match(node: torch.fx.Node) -> dict | None:
    """An SDPA ``node`` of one query token over (repeated) caches -> ``{q, k, v, mask, scale, outs}`` (``outs``: its
    ``getitem(node, 0)`` users) or None."""
    if node.op != "call_function" or node.target not in _sdpa_ops():
        return None
    args = _arguments(node)
    if args.get("dropout_p", 0.0) != 0.0 or args.get("is_causal", False) or args.get("enable_gqa", False):
        return None
    outs = list(node.users)
    if not outs or not all(is_call(u, operator.getitem) and u.args[1] == 0 for u in outs):
        return None
    q, qv = args["query"], value(args["query"])
    if qv is None or qv.dim() != 4 or qv.shape[2] != 1 or qv.device.type not in DEVICES or qv.shape[-1] > 256:
        return None
    kv_shape = value(args["key"]).shape
    if value(args["value"]).shape != kv_shape or kv_shape[0] != qv.shape[0] or kv_shape[1] != qv.shape[1]:
        return None
    k, v = _unrepeated(args["key"], kv_shape), _unrepeated(args["value"], kv_shape)
    if k is None or v is None or value(k).shape != value(v).shape:
        return None
    if value(k).dtype != qv.dtype or value(v).dtype != qv.dtype:
        return None
    mask, ok = _key_mask(args.get("attn_mask", args.get("attn_bias")), qv.shape[0], kv_shape[2])
    if not ok:
        return None
    scale = args.get("scale")
    return {"q": q, "k": k, "v": v, "mask": mask, "scale": qv.shape[-1] ** -0.5 if scale is None else scale,
            "outs": outs}


def replace(graph: torch.fx.Graph) -> int:
    """Replace every decode-step SDPA over HF's static cache in ``graph`` with ``llmplug::dense_decode_attention``;
    returns how many."""
    count = 0
    for node in list(graph.nodes):
        found = match(node)
        if found is None:
            continue
        bsz, heads, _, dim = value(found["q"]).shape
        length = value(found["k"]).shape[2]
        with graph.inserting_before(node):
            q3 = call(graph, aten.reshape.default, found["q"], [bsz, heads, dim])
            mask = found["mask"]
            if mask is not None:
                mask = call(graph, aten.reshape.default, mask, [value(mask).shape[0], length])
                if value(mask).shape[0] != bsz:
                    mask = call(graph, aten.expand.default, mask, [bsz, length])
            out = call(graph, torch.ops.llmplug.dense_decode_attention.default, q3, found["k"], found["v"], mask,
                        float(found["scale"]))
            out4 = call(graph, aten.view.default, out, [bsz, heads, 1, dim])
        for user in found["outs"]:
            user.replace_all_uses_with(out4)
        count += 1
    graph.eliminate_dead_code()
    return count
