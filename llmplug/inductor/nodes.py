"""What the graph passes ask of a post-grad FX node: its call target and its traced value's dtype."""

from __future__ import annotations

import torch


def is_call(node, target) -> bool:
    """``node`` is an FX node calling ``target``."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target


def value(node):
    """The fake value tracing left on ``node`` (a tensor or a tuple), or None (not a node, or none recorded)."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def dtype(node) -> torch.dtype | None:
    return getattr(value(node), "dtype", None)
