"""The one owner of a model's llmplug state: its runner (config, KV pool, graphs), undo log, step lock and the engine
HF's continuous-batching API runs on.

``llmplug.optimize`` builds a :class:`LlmplugState` and keeps it on the model as one attribute (recorded in the undo
log, so ``unoptimize`` removes it); everything else reaches it through :func:`state_of` / :func:`require_state`.

Layering: this module imports nothing of llmplug's runtime; the engine modules import it; ``llmplug.api`` builds it
and registers ``optimize`` here (:func:`register_optimizer`), which is how ``Engine(model)`` optimizes a plain model
without the engine importing the layer above it.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import OptimizeConfig
    from .engine.engine import Engine
    from .engine.runner import ModelRunner
    from .patches.undo import UndoLog

STATE_ATTR = "_llmplug"
_optimizer: list[Callable[..., torch.nn.Module]] = []


@dataclass(eq=False)
class LlmplugState:
    """What llmplug keeps for one optimized model.

    Attributes:
        runner: runs the model's steps; owns the config, the KV pool and the CUDA graphs.
        undo: every change ``optimize`` made, reverted by ``unoptimize``.
        step_lock: held by whoever drives the runner (a ``generate`` call for its whole loop, an engine for each
            step), so ``generate``, a user's :class:`Engine` and the ``generate_batch`` engine never interleave.
        engine: the engine of ``generate_batch`` / ``init_continuous_batching``, made on first use.
        spec_stats: what speculative decoding did in the last ``generate`` call that used it
            (:class:`~llmplug.spec.decode.SpecStats`), None before.
    """

    runner: ModelRunner
    undo: UndoLog
    step_lock: threading.RLock = field(default_factory=threading.RLock)
    engine: Engine | None = None
    spec_stats: object | None = None

    @property
    def config(self) -> OptimizeConfig:
        return self.runner.config


def state_of(model: torch.nn.Module) -> LlmplugState | None:
    """``model``'s llmplug state, or None when it is not optimized."""
    return model.__dict__.get(STATE_ATTR)


def require_state(model: torch.nn.Module) -> LlmplugState:
    """``model``'s llmplug state; ``RuntimeError`` when it is not optimized."""
    state = state_of(model)
    if state is None:
        raise RuntimeError(f"{type(model).__name__} is not optimized by llmplug: call llmplug.optimize(model) first")
    return state


def register_optimizer(optimize: Callable[..., torch.nn.Module]) -> None:
    """``llmplug.api`` hands over ``optimize`` (see the module docstring)."""
    _optimizer[:] = [optimize]


def ensure_state(model: torch.nn.Module, config: OptimizeConfig | None = None) -> LlmplugState:
    """``model``'s state, optimizing it first (with ``config``, or the default settings) when it is not optimized."""
    if state_of(model) is None:
        _optimizer[0](model, config)
    return require_state(model)


def current_state(model: torch.nn.Module) -> LlmplugState:
    """``model``'s state where the model is now. A model moved after ``optimize`` (``model.to(...)``, or a ``pipeline``
    putting a CPU model on the GPU) left its fused weights and KV pool behind: it is optimized again there, with the
    same config and a warning."""
    state = require_state(model)
    param = next(model.parameters())
    was = (state.runner.device, state.runner.dtype)
    if (param.device, param.dtype) == was:
        return state
    warnings.warn(f"the model moved after llmplug.optimize ({was[0]} {was[1]} -> {param.device} {param.dtype}); "
                  "optimizing it again there (optimize after moving the model to skip this)", stacklevel=3)
    state.undo.undo_all()
    return ensure_state(model, state.config)
