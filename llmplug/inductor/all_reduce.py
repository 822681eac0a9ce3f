"""Under tensor parallelism: a row-parallel projection's all-reduce feeding the residual add + RMSNorm after it,
in a post-grad FX graph, becomes ``llmplug::all_reduce_add_rms_norm`` (:mod:`llmplug.parallel.all_reduce_norm`).

Dynamo traces an all-reduce (llmplug's split forward hooks, or any ``torch.distributed.all_reduce``) as
``wait_tensor(all_reduce(x, "sum", group))``. Where that sum, alone or times a constant (Granite's residual
multiplier), is one of the two inputs of an ``llmplug::add_rms_norm`` (:func:`~llmplug.inductor.rms_norm.fuse_residual`
runs first) and has no other use, the three become one op.
"""

from __future__ import annotations

import torch

from ..parallel import all_reduce_norm  # noqa: F401 - registers llmplug::all_reduce_add_rms_norm
from .nodes import is_call


def _collectives() -> tuple | None:
    """The traced all-reduce and wait ops, or None on a torch built without them (then no graph holds them)."""
    try:
        ops = torch.ops._c10d_functional
        return ops.all_reduce.default, ops.wait_tensor.default
    except (AttributeError, RuntimeError):
        return None


def _summed(node, all_reduce, wait) -> tuple[torch.fx.Node, float, str] | None:
    """``(x, scale, group)`` where ``node`` is ``scale * all_reduce(x, "sum", group)`` used once, else None."""
    scale = 1.0
    if is_call(node, torch.ops.aten.mul.Tensor) and isinstance(node.args[1], (int, float)) and len(node.users) == 1:
        node, scale = node.args[0], float(node.args[1])
    if not (is_call(node, wait) and len(node.users) == 1):
        return None
    reduce = node.args[0]
    if not (is_call(reduce, all_reduce) and reduce.args[1] == "sum" and len(reduce.users) == 1):
        return None
    return reduce.args[0], scale, reduce.args[2]


def fuse(graph: torch.fx.Graph) -> int:
    """Replace each all-reduce + residual add + RMSNorm of ``graph``; returns how many."""
    ops = _collectives()
    if ops is None:
        return 0
    count = 0
    for node in list(graph.nodes):
        if not is_call(node, torch.ops.llmplug.add_rms_norm.default):
            continue
        for i in (0, 1):
            found = _summed(node.args[i], *ops)
            if found is None:
                continue
            x, scale, group = found
            with graph.inserting_before(node):
                fused = graph.call_function(torch.ops.llmplug.all_reduce_add_rms_norm.default,
                                            (x, node.args[1 - i], *node.args[2:], scale, group))
            fused.meta.update(node.meta)
            node.replace_all_uses_with(fused)
            count += 1
            break
    graph.eliminate_dead_code()
    return count
