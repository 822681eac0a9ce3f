"""Find few-row projections in a post-grad FX graph and call llmplug's GEMV instead of a matmul.

A decode step multiplies a row per sequence by every weight: ``mm(x (M, K), permute(W (N, K), [1, 0]))``, or
``addmm(bias, x, permute(W))`` with a bias. cuBLAS runs those as small-N GEMMs; llmplug's kernels read the weight at a
higher rate (BENCHMARKS.md, "gemv_sweep", "Speculative decoding"). One row becomes ``llmplug::gemv(x, W, bias,
config)`` with the config :func:`~llmplug.ops.gemv.choose_config` picks for ``(N, K)``; 2 to
:data:`~llmplug.ops.skinny_gemv.MAX_ROWS` rows ``llmplug::skinny_gemv``. Matched: a static row count and a 16-bit
weight of unit stride along K that the graph takes as an input (a parameter or buffer, never a tensor it computes:
under programmatic launch the kernels read weights before their predecessors finish), on a device in
:data:`DEVICES` (CUDA: elsewhere the op is only its reference).
"""

from __future__ import annotations

import torch

from ..ops import skinny_gemv
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
    """``mm``/``addmm`` ``node`` of a few rows by a transposed weight -> ``{x, weight, bias}`` or None."""
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
        return None  # a symbolic row count (dynamic shapes) is not known to be few
    if not 1 <= xv.shape[0] <= skinny_gemv.MAX_ROWS or xv.stride(1) != 1 or wv.stride(1) != 1:
        return None
    if xv.dtype != wv.dtype or xv.dtype not in DTYPES:
        return None
    if wv.device.type not in DEVICES:
        return None
    if bias is not None and (dtype(bias) != xv.dtype or value(bias).shape != (wv.shape[0],)):
        return None
    return {"x": x, "weight": weight, "bias": bias}


def replace(graph: torch.fx.Graph) -> dict[str, int]:
    """Replace every few-row projection of ``graph`` with ``llmplug::gemv`` (one row) or ``llmplug::skinny_gemv``;
    returns how many of each."""
    counts = {"gemv": 0, "skinny_gemv": 0}
    for node in list(graph.nodes):
        found = match(node)
        if found is None:
            continue
        n, k = value(found["weight"]).shape
        x, weight, bias = found["x"], found["weight"], found["bias"]
        with graph.inserting_before(node):
            if value(x).shape[0] == 1:
                op, args = torch.ops.llmplug.gemv.default, (x, weight, bias, "", *choose_config(n, k), False)
            else:
                config = skinny_gemv.choose_config(n, k, value(weight).element_size())
                op, args = torch.ops.llmplug.skinny_gemv.default, (x, weight, bias, *config, False)
            new = graph.call_function(op, args)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        counts["gemv" if op is torch.ops.llmplug.gemv.default else "skinny_gemv"] += 1
    graph.eliminate_dead_code()
    return counts
