"""What the graph passes ask of a post-grad FX node (its call target, its traced value's dtype), and how they insert
one with its traced value."""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode


def is_call(node, target) -> bool:
    """``node`` is an FX node calling ``target``."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def is_view(node) -> bool:
    """``node`` is a view or reshape of its first argument."""
    return any(is_call(node, view) for view in _VIEWS)


def value(node):
    """The fake value tracing left on ``node`` (a tensor or a tuple), or None (not a node, or none recorded)."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def dtype(node) -> torch.dtype | None:
    return getattr(value(node), "dtype", None)


def fake_value(target, *args):
    """The fake value ``target(*args)`` gives, nodes standing for their traced values."""
    def val(x):
        return value(x) if isinstance(x, torch.fx.Node) else [val(a) for a in x] if isinstance(x, list) else x

    vals = [val(x) for x in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, (torch.Tensor, list))])
    if mode is None:
        raise RuntimeError(f"llmplug's graph passes found no traced values for {target}'s inputs")
    with mode:
        return target(*vals)


def call(graph: torch.fx.Graph, target, *args) -> torch.fx.Node:
    """Insert ``target(*args)`` (at the graph's insertion point) with its fake value."""
    node = graph.call_function(target, args)
    node.meta["val"] = fake_value(target, *args)
    return node
