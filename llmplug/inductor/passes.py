"""llmplug's post-grad graph pass for Inductor, and the report of what it matched."""

from __future__ import annotations

import collections
import hashlib
from pathlib import Path

from torch._inductor.custom_graph_pass import CustomGraphPass

# each pattern module imports (registers) the llmplug ops it emits: a graph Inductor serves from its FX cache calls
# them without this pass having run
from . import act_mul, all_reduce, attention, gemv, merge, nodes, rms_norm, rope_attention

# pattern name -> replace(graph) -> matches (or matches by name); run in this order
PATTERNS = {"rms_norm": rms_norm.replace, "add_rms_norm": rms_norm.fuse_residual,
            "all_reduce_add_rms_norm": all_reduce.fuse, "act_mul": act_mul.replace,
            "dense_decode_attention": attention.replace, "rope_dense_decode_attention": rope_attention.replace,
            "gemv": gemv.replace, "gemv_group": merge.group,
            "gated_gemv": merge.gate, "norm_prologue": merge.prologue}
_report: collections.Counter = collections.Counter()


def report() -> dict[str, int]:
    """Matches of each pattern over the graphs this process compiled with the ``llmplug`` backend since
    :func:`reset_report` (a graph Inductor serves from its FX graph cache is not compiled, so not counted again)."""
    return dict(_report)


def reset_report() -> None:
    _report.clear()


class LlmplugPass(CustomGraphPass):
    """Inductor's ``post_grad_custom_post_pass``: llmplug's patterns, then the pass the user had set (if any).

    Args:
        after: the user's own post-grad pass, kept running after llmplug's.
    """

    def __init__(self, after=None) -> None:
        self.after = after

    def __call__(self, graph) -> None:
        for name, replace in PATTERNS.items():
            found = replace(graph)  # a count, or counts by name
            _report.update(found if isinstance(found, dict) else {name: found})
        if self.after is not None:
            self.after(graph)

    def uuid(self) -> bytes:
        """The FX graph cache key: llmplug's pattern sources and the user's pass's own key."""
        h = hashlib.sha256()
        h.update(Path(__file__).read_bytes())
        for module in (nodes, rms_norm, all_reduce, act_mul, attention, rope_attention, gemv, merge):
            h.update(Path(module.__file__).read_bytes())
        after = getattr(self.after, "uuid", None)
        if self.after is not None:
            h.update(repr(after() if after is not None else id(self.after)).encode())
        return h.digest()
