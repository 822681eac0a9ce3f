"""Undo log: every change llmplug makes to a model instance is recorded here and reverted in reverse order."""

from __future__ import annotations

from collections.abc import Callable

import torch

_MISSING = object()


class UndoLog:
    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def record(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def set_attr(self, obj: object, name: str, value: object) -> None:
        """``setattr(obj, name, value)`` on the instance, restoring the instance's previous state on undo."""
        old = obj.__dict__.get(name, _MISSING)
        setattr(obj, name, value)

        def undo():
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

        self.record(undo)

    def fuse_parameters(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """Concatenate ``params`` along dim 0 into one tensor and make each parameter a view of its rows.

        The parameters stay the same objects (optimizers and state dicts keep working); their old storage is freed.
        Undo gives each one its own contiguous copy again, bit-identical.
        """
        fused = torch.cat([p.data for p in params], dim=0)
        start = 0
        for p in params:
            rows = p.shape[0]
            p.data = fused[start:start + rows]
            start += rows

        def undo():
            for p in params:
                p.data = p.data.clone()

        self.record(undo)
        return fused

    def undo_all(self) -> None:
        while self._undo:
            self._undo.pop()()
