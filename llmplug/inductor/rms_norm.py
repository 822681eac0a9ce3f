"""Find RMSNorm in a post-grad FX graph and call llmplug's op instead.

The traced forms (any HF family, any dtype): ``xf = x`` or ``x.float()``; ``r = rsqrt(mean(xf^2, -1, keepdim) + eps)``;
``n = xf * r``; then Llama style ``w * n.to(x.dtype)`` (offset 0, rounded first), Gemma style ``(n * (1 +
w.float())).to(x.dtype)`` (offset 1) or OLMo 2 style ``(w * n).to(x.dtype)`` (offset 0, fp32 to the end). Each match
becomes ``llmplug::rms_norm(x, w, eps, offset, round_first)``, and one whose input is the residual stream's add (``x =
a + b``) ``llmplug::add_rms_norm(a, b, w, eps, offset, round_first)``. Only a constant ``eps`` matches: under
``dynamic=True`` Dynamo makes a module's float attribute a graph input, and those norms stay as they are.
"""

from __future__ import annotations

import operator

import torch

from .nodes import dtype, is_call, value

aten, prims = torch.ops.aten, torch.ops.prims
_CAST = prims.convert_element_type.default


def _arg(node, i):
    return node.args[i] if len(node.args) > i else None


def _only_user(node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _other(node, known):
    """The operand of a binary ``node`` that is not ``known`` (None if neither is)."""
    a, b = node.args[0], node.args[1]
    return b if a is known else a if b is known else None


def match(rsqrt: torch.fx.Node) -> dict | None:
    """The RMSNorm around ``rsqrt`` -> ``{x, weight, eps, offset, out}`` or None."""
    add = _arg(rsqrt, 0)
    if not is_call(add, aten.add.Tensor) or not isinstance(add.args[1], float):
        return None
    mean = add.args[0]
    if not is_call(mean, aten.mean.dim) or list(mean.args[1]) != [-1] or not (len(mean.args) > 2 and mean.args[2]):
        return None
    square = mean.args[0]
    if not is_call(square, aten.pow.Tensor_Scalar) or square.args[1] != 2:
        return None
    xf = square.args[0]
    x = xf.args[0] if is_call(xf, _CAST) and xf.args[1] == torch.float32 else xf
    if dtype(mean) != torch.float32:
        return None
    normed = next((u for u in rsqrt.users if is_call(u, aten.mul.Tensor) and _other(u, rsqrt) is xf), None)
    if normed is None or len(rsqrt.users) != 1:
        return None
    step = _only_user(normed)
    if is_call(step, _CAST) and step.args[1] == dtype(x):  # Llama: round to x's dtype, then the weight
        mul = _only_user(step)
        if is_call(mul, aten.mul.Tensor):
            weight = _other(mul, step)
            if dtype(weight) == dtype(x) and dtype(mul) == dtype(x):
                return {"x": x, "weight": weight, "eps": add.args[1], "offset": 0.0, "round_first": True, "out": mul}
        return None
    if is_call(step, aten.mul.Tensor):
        scale = _other(step, normed)
        if is_call(scale, aten.add.Tensor) and scale.args[1] == 1.0:  # Gemma: (1 + w) in fp32, cast at the end
            weight = scale.args[0].args[0] if is_call(scale.args[0], _CAST) else scale.args[0]
            end = _only_user(step)
            out = end if is_call(end, _CAST) and end.args[1] == dtype(x) else step
            if dtype(out) == dtype(x):
                return {"x": x, "weight": weight, "eps": add.args[1], "offset": 1.0, "round_first": False, "out": out}
            return None
        if dtype(x) == torch.float32 and dtype(scale) == torch.float32:  # Llama in fp32: no casts at all
            return {"x": x, "weight": scale, "eps": add.args[1], "offset": 0.0, "round_first": True, "out": step}
        end = _only_user(step)
        if dtype(scale) == dtype(x) and is_call(end, _CAST) and end.args[1] == dtype(x):  # OLMo 2: w * n in fp32
            return {"x": x, "weight": scale, "eps": add.args[1], "offset": 0.0, "round_first": False, "out": end}
    return None


def replace(graph: torch.fx.Graph) -> int:
    """Replace every RMSNorm of ``graph`` with ``llmplug::rms_norm``; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if not is_call(node, aten.rsqrt.default):
            continue
        found = match(node)
        if found is None:
            continue
        out = found["out"]
        with graph.inserting_before(out):
            fused = graph.call_function(torch.ops.llmplug.rms_norm.default,
                                        (found["x"], found["weight"], found["eps"], found["offset"],
                                         found["round_first"]))
        fused.meta.update(out.meta)
        out.replace_all_uses_with(fused)
        count += 1
    graph.eliminate_dead_code()
    return count


def fuse_residual(graph: torch.fx.Graph) -> int:
    """``llmplug::rms_norm(a + b, ...)`` where ``a + b`` is the residual stream (same shape and dtype) ->
    ``llmplug::add_rms_norm(a, b, ...)``, whose second output replaces every other use of the sum; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if not is_call(node, torch.ops.llmplug.rms_norm.default):
            continue
        add = node.args[0]
        if not is_call(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
            continue
        a, b = add.args
        vals = [value(t) for t in (a, b, add)]
        if any(v is None for v in vals) or len({(str(v.shape), v.dtype) for v in vals}) != 1:
            continue  # a scalar or a broadcast: not a residual add
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.llmplug.add_rms_norm.default, (a, b, *node.args[1:]))
            normed = graph.call_function(operator.getitem, (fused, 0))
            total = graph.call_function(operator.getitem, (fused, 1))
        fused.meta["val"] = (node.meta["val"], add.meta["val"])
        normed.meta.update(node.meta)
        total.meta.update(add.meta)
        node.replace_all_uses_with(normed)
        add.replace_all_uses_with(total)
        count += 1
    graph.eliminate_dead_code()
    return count
