"""Models split over tensor-parallel ranks from the start: each rank builds the model with its parameters on the meta
device and reads only its own slices (a local safetensors checkpoint, or random values for benchmark shapes), so no
rank ever holds a whole copy. ``optimize`` then takes the split as it is."""

from __future__ import annotations

import contextlib
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from ..patches.undo import UndoLog
from ..quant.hf_quantizer import LlmplugQuantConfig, record_quantized, replace_with_empty_quant_linears
from .group import resolve
from .shard import shard_model
from .sources import Checkpoint, RandomInit

SPLIT_ATTR = "_llmplug_split"  # (TPGroup, UndoLog) of a model split at load time, taken over by optimize


def _device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules made inside keep their parameters on the meta device (each is allocated, then dropped, one at a time)
    and their buffers where they are made: computed buffers (rotary frequencies, embedding scales) keep their
    values."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _split(config, make_source, dtype: torch.dtype, device: torch.device, tensor_parallel, overrides: dict):
    from ..api import optimize

    tp = resolve(tensor_parallel)
    saved = getattr(config, "quantization_config", None)
    quant = None
    if saved is not None:  # an llmplug-quantized checkpoint: its quantized linears, empty, before the split
        quant = LlmplugQuantConfig(**{k: v for k, v in dict(saved).items() if k != "quant_method"})
        del config.quantization_config  # transformers would look for a quantizer while building
    with torch.device(device), _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if quant is not None:
        model.config.quantization_config = saved
        record_quantized(model, quant, replace_with_empty_quant_linears(model, quant))
    log = UndoLog()
    shard_model(model, tp, log, make_source(model))
    model.__dict__[SPLIT_ATTR] = (tp, log)
    return optimize(model, tensor_parallel=tp.size, **overrides)


def load_split(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, device=None,
               tensor_parallel: int | str = "auto", **overrides) -> torch.nn.Module:
    """An HF causal LM from a local safetensors checkpoint (dense, or written by :func:`llmplug.save_quantized`), split
    over the ``torch.distributed`` ranks and optimized: every rank reads only its slices (a 70B model on four
    GPUs never needs a whole copy anywhere). With one process it is ``from_pretrained`` and :func:`llmplug.optimize`.

    Args:
        path: a checkpoint directory (``config.json``, ``model.safetensors`` or shards with an index); no remote code
            is run.
        dtype: the weights' dtype; device: this rank's device (default: the current CUDA device, else the CPU).
        tensor_parallel: as :class:`~llmplug.OptimizeConfig`; ``overrides``: other ``optimize`` settings.
    """
    device = _device(device)
    if resolve(tensor_parallel) is None:
        from ..api import optimize
        from ..loading import load_causal_lm

        return optimize(load_causal_lm(path, device, dtype=dtype), **overrides)
    model = _split(AutoConfig.from_pretrained(path), lambda m: Checkpoint(path, m, device), dtype, device,
                   tensor_parallel, overrides)
    if os.path.exists(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def build_split(config, dtype: torch.dtype = torch.bfloat16, device=None, tensor_parallel: int | str = "auto",
                **overrides) -> torch.nn.Module:
    """A random-weight model of ``config`` (an HF config) split over the ranks and optimized, each rank making only
    its slices (:class:`~llmplug.parallel.sources.RandomInit`): benchmark shapes too big for one device."""
    device = _device(device)
    return _split(config, lambda m: RandomInit(m, dtype, device), dtype, device, tensor_parallel, overrides)
