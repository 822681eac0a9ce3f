"""``optimize(model)`` / ``unoptimize(model)``: switch one HF model onto llmplug in place, and back."""

from __future__ import annotations

import types

import torch

from .config import OptimizeConfig
from .engine.attention import RUNTIME_ATTR
from .engine.generate import llmplug_generate
from .engine.hf_batching import install as install_hf_batching
from .engine.runner import ModelRunner, hf_forward
from .parallel.group import register as register_tp
from .parallel.group import resolve as resolve_tp
from .parallel.load import SPLIT_ATTR
from .parallel.shard import shard_model
from .patches.decoder import FusedDecoder
from .patches.registry import check_supported, family_of
from .patches.undo import UndoLog
from .quant.quantize import quantize
from .state import STATE_ATTR, LlmplugState, register_optimizer, state_of


def _module(model) -> torch.nn.Module:
    """``model`` itself; a :class:`TypeError` naming what was passed unless it is a loaded ``torch.nn.Module``."""
    if isinstance(model, torch.nn.Module):
        return model
    source = repr(model) if isinstance(model, str) else "name_or_path"
    raise TypeError(f"llmplug expects a loaded transformers model (a torch.nn.Module), got {type(model).__name__} "
                    f"{model!r:.80}; load it first, e.g. model = AutoModelForCausalLM.from_pretrained({source})")


def is_optimized(model: torch.nn.Module) -> bool:
    return state_of(_module(model)) is not None


def optimize(model: torch.nn.Module, config: OptimizeConfig | None = None, **overrides) -> torch.nn.Module:
    """Make ``model.generate`` run on llmplug: paged KV, fused kernels, CUDA graphs. In place; returns ``model``.

    With ``quantize=...`` the linear layers are quantized first (:func:`llmplug.quantize`); that is lossy and is
    the one change :func:`unoptimize` keeps (the original weights are freed; reload the model to get them back).

    Args:
        model: a decoder-only HF causal LM, already on its device and dtype.
        config: an :class:`OptimizeConfig`; keyword ``overrides`` replace single fields (unknown keys raise).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` (a checkpoint name, say: load the model first).
        UnsupportedModelError: the model cannot run on llmplug (the message names its ``model_type``).
    """
    _module(model)  # before the config: a checkpoint name is the likelier mistake
    config = OptimizeConfig.from_overrides(config, **overrides)
    if is_optimized(model):
        if state_of(model).config != config:
            raise ValueError("model is already optimized with a different config; call llmplug.unoptimize first")
        return model
    check_supported(model)
    if config.quantize is not None:
        quantize(model, config.quantize, config.group_size, config.quantize_exclude)
    tp = resolve_tp(config.tensor_parallel)
    log = UndoLog()
    split = model.__dict__.pop(SPLIT_ATTR, None)  # split already at load time (llmplug.parallel.load)
    if split is not None:
        if tp is None or tp.size != split[0].size:
            model.__dict__[SPLIT_ATTR] = split
            raise ValueError(f"the model was loaded split over {split[0].size} ranks: optimize it with "
                             f"tensor_parallel={split[0].size}")
        tp, log = split
    try:
        if tp is not None and split is None:
            shard_model(model, tp, log)
        family = family_of(model) if config.fuse else None
        forward = FusedDecoder(model, family[0], family[1], log, tp) if family else hf_forward
    except BaseException:
        log.undo_all()
        raise
    runner = ModelRunner(model, config, forward, tp)
    if tp is not None:
        log.record(register_tp(tp))  # compiled graphs' all-reduces find it (llmplug.inductor.all_reduce)
    for module in model.modules():
        if hasattr(module, "layer_idx"):
            log.set_attr(module, RUNTIME_ATTR, runner)
    state = LlmplugState(runner, log)
    log.set_attr(model, "generate", types.MethodType(llmplug_generate, model))
    install_hf_batching(model, log)  # generate_batch / init_continuous_batching on llmplug's Engine
    log.record(runner.release)
    log.set_attr(model, STATE_ATTR, state)
    return model


def unoptimize(model: torch.nn.Module) -> torch.nn.Module:
    """Revert everything :func:`optimize` did (weights layout, methods, attributes) and free the KV pool.

    Quantized linears stay quantized (see :func:`optimize`); the model then runs them under the stock HF forward.
    """
    state = state_of(_module(model))
    if state is not None:
        state.undo.undo_all()
    return model


register_optimizer(optimize)
