"""Find the gated activation ``act(gate) * up`` (SiLU, GELU-tanh) in a post-grad FX graph and call llmplug's op.

HF's MLPs compute ``act_fn(gate_proj(x)) * up_proj(x)`` (Phi-3: ``up * act_fn(gate)``); each match becomes
``llmplug::act_mul(gate, up, act)``, which rounds where HF's eager forward rounds (``act(gate)`` to the model dtype
first). The patterns are traced the way Inductor traces the model (``torch._inductor.pattern_matcher``, forward
decompositions), once per dtype, so the casts a 16-bit graph carries match too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import act_mul as _op  # noqa: F401 - registers llmplug::act_mul

_PATTERNS = None  # the pattern pass, traced on first use (tracing takes a moment; most processes never compile)


def _silu(gate, up):
    return F.silu(gate) * up


def _gelu_tanh(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def _up_silu(gate, up):  # Phi-3's order: up * act(gate)
    return up * F.silu(gate)


def _up_gelu_tanh(gate, up):
    return up * F.gelu(gate, approximate="tanh")


def _silu_op(gate, up):
    return torch.ops.llmplug.act_mul.default(gate, up, "silu")


def _gelu_tanh_op(gate, up):
    return torch.ops.llmplug.act_mul.default(gate, up, "gelu_tanh")


def _patterns():
    global _PATTERNS
    if _PATTERNS is None:
        from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

        patterns = PatternMatcherPass()
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            example = [torch.empty(2, 8, dtype=dtype), torch.empty(2, 8, dtype=dtype)]
            for silu in (_silu, _up_silu):
                register_replacement(silu, _silu_op, example, fwd_only, patterns)
            for gelu in (_gelu_tanh, _up_gelu_tanh):
                register_replacement(gelu, _gelu_tanh_op, example, fwd_only, patterns)
        _PATTERNS = patterns
    return _PATTERNS


def replace(graph: torch.fx.Graph) -> int:
    """Replace every SiLU / GELU-tanh gated activation of ``graph`` with ``llmplug::act_mul``; returns how many."""
    return _patterns().apply(graph)
