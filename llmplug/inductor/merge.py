"""Merge the one-row GEMVs that share their input into one launch, and fold their neighbours in (after :mod:`gemv`).

q/k/v (and gate/up) each multiply the same normalised row: :func:`group` makes one ``llmplug::gemv_group`` read all
their weights where they lie (no concatenated copy), its output sliced back into each projection's.
:func:`gate` turns a gate/up group whose two products feed one ``llmplug::act_mul`` into the gated GEMV, the
activation in its epilogue (so does a fused gate/up weight's split product). :func:`prologue` moves the residual add
+ RMSNorm (``llmplug::add_rms_norm``) that makes a GEMV's input into its prologue, where its weights are small enough
(:func:`~llmplug.ops.gemv.norm_in_prologue`). Each saves a launch and a round trip through memory per layer.
"""

from __future__ import annotations

import operator

import torch

from ..ops.gemv import choose_config, norm_in_prologue
from .nodes import call, is_call, is_view, value

aten = torch.ops.aten
MAX_GROUP = 3  # weights one launch reads (the kernel's stacked-row layout)
_GATED = 7  # gemv_group's argument index of ``gated``


def _base(node):
    """``node`` with the views and reshapes above it stripped (the tensor whose data it is)."""
    while is_view(node):
        node = node.args[0]
    return node


def _consumers(node) -> list:
    """Every node that uses ``node``'s data, through views."""
    out = []
    for user in node.users:
        out += _consumers(user) if is_view(user) else [user]
    return out


def _group_node(graph, x, weights, norm, gated):
    """``llmplug::gemv_group`` and its two outputs ``(y, residual_out)``."""
    n, k = sum(value(w).shape[0] for w in weights), value(weights[0]).shape[1]
    config = choose_config(n, k)  # an even row count a program, as a gated GEMV needs
    residual, norm_weight, eps, offset, round_first = norm or (None, None, 0.0, 0.0, True)
    node = call(graph, torch.ops.llmplug.gemv_group.default, x, list(weights), residual, norm_weight, eps, offset,
                round_first, gated, *config)
    return node, call(graph, operator.getitem, node, 0), call(graph, operator.getitem, node, 1)


def _plain_gemv(node) -> bool:
    """A ``llmplug::gemv`` without bias, activation or fp32 output."""
    return is_call(node, torch.ops.llmplug.gemv.default) and node.args[2] is None and node.args[3] == "" and \
        not node.args[8]


def group(graph: torch.fx.Graph) -> int:
    """Sibling plain GEMVs (one input row, one dtype, K and row stride) -> ``llmplug::gemv_group`` of up to
    :data:`MAX_GROUP`, each sibling's output a slice of the group's; returns how many groups."""
    siblings: dict = {}
    for node in graph.nodes:
        if _plain_gemv(node):
            w = value(node.args[1])
            siblings.setdefault((_base(node.args[0]), w.dtype, w.shape[1], w.stride()), []).append(node)
    count = 0
    for members in siblings.values():
        for start in range(0, len(members) - 1, MAX_GROUP):
            chunk = members[start:start + MAX_GROUP]
            if len(chunk) < 2:
                continue
            with graph.inserting_before(chunk[0]):
                _, y, _ = _group_node(graph, chunk[0].args[0], [m.args[1] for m in chunk], None, "")
                offset = 0
                for member in chunk:
                    n = value(member.args[1]).shape[0]
                    part = call(graph, aten.slice.Tensor, y, 1, offset, offset + n)
                    member.replace_all_uses_with(part)
                    offset += n
            count += 1
    graph.eliminate_dead_code()
    return count


def _parts(node) -> list | None:
    """A plain group's slice nodes in order (every user of its output a slice), or None."""
    if not is_call(node, torch.ops.llmplug.gemv_group.default) or node.args[2] is not None or node.args[_GATED]:
        return None
    outs = [u for u in node.users if u.args[1] == 0]
    if len(outs) != 1 or not all(is_call(s, aten.slice.Tensor) for s in outs[0].users):
        return None
    return sorted(outs[0].users, key=lambda s: s.args[2])


def _halves(node) -> list | None:
    """A plain GEMV's output split into two equal halves along its last dim (a fused gate/up, Phi-3's ``chunk(2)``),
    and nothing else: the halves' ``getitem`` nodes in order, or None."""
    if not _plain_gemv(node):
        return None
    users = _consumers(node)
    split = users[0] if len(users) == 1 else None
    n = value(node).shape[-1]
    if not is_call(split, aten.split.Tensor) or split.args[1] != n // 2 or n % 2 or \
            (split.args[2] if len(split.args) > 2 else 0) not in (-1, value(split.args[0]).dim() - 1):
        return None
    halves = sorted(split.users, key=lambda g: g.args[1])
    return halves if [g.args[1] for g in halves] == [0, 1] else None


def gate(graph: torch.fx.Graph) -> int:
    """Gate and up products that are only ``llmplug::act_mul(gate, up, act)``'s inputs (through views): a
    two-weight group's slices, or the halves of one fused gate/up weight's product -> the gated GEMV (``act`` in its
    epilogue); returns how many."""
    count = 0
    for node in list(graph.nodes):
        parts = _parts(node)
        fused = None if parts is not None else _halves(node)
        pair = parts if parts is not None and len(parts) == 2 else fused
        if pair is None:
            continue
        users = {u for p in pair for u in _consumers(p)}
        act = next(iter(users)) if len(users) == 1 else None
        if not is_call(act, torch.ops.llmplug.act_mul.default) or [_base(a) for a in act.args[:2]] != pair:
            continue
        with graph.inserting_before(node):
            if fused is not None:
                x, weight = node.args[0], node.args[1]
                y = call(graph, torch.ops.llmplug.gemv.default, x, weight, None, act.args[2], *node.args[4:8], False)
            elif value(node.args[1][0]).shape == value(node.args[1][1]).shape:
                _, y, _ = _group_node(graph, node.args[0], node.args[1], None, act.args[2])
            else:
                continue
            out = call(graph, aten.view.default, y, list(value(act).shape))
        act.replace_all_uses_with(out)
        count += 1
    graph.eliminate_dead_code()
    return count


def _weights(node) -> list | None:
    """The weights a GEMV without a norm prologue reads: a group's, or a one-row ``llmplug::gemv``'s (any bias or
    activation, not fp32 output); None for anything else."""
    if is_call(node, torch.ops.llmplug.gemv_group.default) and node.args[2] is None:
        return list(node.args[1])
    if is_call(node, torch.ops.llmplug.gemv.default) and not node.args[8]:
        return [node.args[1]]
    return None


def prologue(graph: torch.fx.Graph) -> int:
    """``llmplug::add_rms_norm`` whose normalised output feeds one GEMV only (a group, or one weight such as a fused
    q/k/v), its weights small enough -> the add and the norm in that GEMV's prologue, its second output the new
    residual; returns how many."""
    count = 0
    for node in list(graph.nodes):
        weights = _weights(node)
        if weights is None:
            continue
        normed = _base(node.args[0])
        fused = normed.args[0] if is_call(normed, operator.getitem) and normed.args[1] == 0 else None
        if not is_call(fused, torch.ops.llmplug.add_rms_norm.default) or set(_consumers(normed)) != {node}:
            continue
        if not norm_in_prologue(sum(value(w).numel() for w in weights)):
            continue
        total = next((u for u in fused.users if u.args[1] == 1), None)
        order = {n: i for i, n in enumerate(graph.nodes)}
        if total is not None and any(order[u] < order[node] for u in total.users):
            continue  # the new residual is read before the GEMV runs
        a, b, norm_weight, eps, offset, round_first = fused.args
        row = list(value(node.args[0]).shape)
        with graph.inserting_before(node):
            x, residual = call(graph, aten.view.default, a, row), call(graph, aten.view.default, b, row)
            if is_call(node, torch.ops.llmplug.gemv.default):  # (x, weight, bias, gated, *config, fp32_out)
                new = call(graph, torch.ops.llmplug.add_norm_gemv.default, x, residual, norm_weight, eps, offset,
                           round_first, node.args[1], node.args[2], node.args[3], *node.args[4:8])
                y, residual_out = call(graph, operator.getitem, new, 0), call(graph, operator.getitem, new, 1)
            else:
                _, y, residual_out = _group_node(graph, x, weights, (residual, norm_weight, eps, offset, round_first),
                                                 node.args[_GATED])
            if total is not None:
                total.replace_all_uses_with(call(graph, aten.view.default, residual_out, list(value(a).shape)))
        if is_call(node, torch.ops.llmplug.gemv.default):
            node.replace_all_uses_with(y)
        else:
            for out in [u for u in node.users if u.args[1] == 0]:
                out.replace_all_uses_with(y)
        count += 1
    graph.eliminate_dead_code()
    return count
