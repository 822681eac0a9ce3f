"""llmplug as a ``torch.compile`` backend: Inductor with passes that put llmplug's fused ops into any HF model's graph
(:mod:`.backend`); :func:`report` says what they matched."""

from .backend import llmplug_backend, register
from .passes import report, reset_report

__all__ = ["llmplug_backend", "register", "report", "reset_report"]
