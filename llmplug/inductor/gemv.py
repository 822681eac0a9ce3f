"""Find one-row projections in a post-grad FX graph and call llmplug's GEMV instead of a matmul.

A decode step at batch 1 multiplies one row by every weight: ``mm(x (1, K), permute(W (N, K), [1, 0]))``, or
``addmm(bias, x, permute(W))`` with a bias. cuBLAS runs those as small-N GEMMs; llmplug's GEMV reads the weight at a
higher rate (BENCHMARKS.md, "gemv_sweep"). Each match becomes ``llmplug::gemv(x, W, bias, config)`` with the config
:func:`~llmplug.ops.gemv.choose_config` picks for ``(N, K)``. Matched: a static single row and a 16-bit weight of unit
stride along K that the graph takes as an input (a parameter or buffer, never a tensor it computes: under programmatic
launch the kernel reads weights before its predecessors finish), on a device in :data:`DEVICES` (CUDA: elsewhere the
op is only its reference).
"""

from __future__ import annotations

import torch

from ..ops.gemv import choose_config
from .nodes import dtype, is_call, value

aten = torch.ops.aten
DEVICES = ("cuda",)  # where the GEMV is a kernel of its own; tests add "cpu" to exercise the matching
DTYPES = (torch.bfloat16, torch.float16)  # where it beats cuBLAS; tests add fp32 to check tokens against stock


def _writes(node: torch.fx.Node) -> bool:
    """``node`` calls an op that mutates one of its arguments (``copy_``, ``index_copy_``, ...)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def match(node: torch.fx.Node) -> dict | None:
    """``mm``/``addmm`` ``node`` of one row by a transposed weight -> ``{x, weight, bias}`` or None."""
    if is_call(node, aten.mm.default):
        bias, (x, wt) = None, node.args
    elif is_call(node, aten.addmm.default) and not node.kwargs:
        bias, x, wt = node.args
    else:
        return None
    if not is_call(wt, aten.permute.default) or list(wt.args[1]) != [1, 0]:
        return None
    weight = wt.args[0]
    if weight.op not in ("placeholder", "get_attr") or any(_writes(user) for user in weight.users):
        return None  # a weight the graph computes or writes: the kernel reads its first tile before the PDL wait
    xv, wv = value(x), value(weight)
    if xv is None or wv is None or xv.dim() != 2 or wv.dim() != 2 or not isinstance(xv.shape[0], int):
        return None  # a symbolic row count (dynamic shapes) is not known to be one
    if xv.shape[0] != 1 or xv.stride(1) != 1 or wv.stride(1) != 1 or xv.dtype != wv.dtype or \
            xv.dtype not in DTYPES:
        return None
    if wv.device.type not in DEVICES:
        return None
    if bias is not None and (dtype(bias) != xv.dtype or value(bias).shape != (wv.shape[0],)):
        return None
    return {"x": x, "weight": weight, "bias": bias}


def replace(graph: torch.fx.Graph) -> int:
    """Replace every one-row projection of ``graph`` with ``llmplug::gemv``; returns how many."""
    count = 0
    for node in list(graph.nodes):
        found = match(node)
        if found is None:
            continue
        n, k = value(found["weight"]).shape
        with graph.inserting_before(node):
            gemv = graph.call_function(torch.ops.llmplug.gemv.default,
                                       (found["x"], found["weight"], found["bias"], "", *choose_config(n, k), False))
        gemv.meta.update(node.meta)
        node.replace_all_uses_with(gemv)
        count += 1
    graph.eliminate_dead_code()
    return count
