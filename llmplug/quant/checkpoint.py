"""``save_quantized`` / ``from_quantized``: llmplug-quantized models as safetensors checkpoints.

A checkpoint is what ``save_pretrained`` writes (``config.json``, ``generation_config.json``, ``model.safetensors``
or shards with an index), with ``config.json`` carrying

    "quantization_config": {"quant_method": "llmplug", "method": "int4", "group_size": 128, "modules": [...], ...}

and the safetensors holding each quantized linear's buffers (``qweight``, ``scales``, ``zeros``, ``perm`` where the
linear is listed in ``"permuted"``) and ``bias`` under its name, beside the model's other parameters. Loading goes
through transformers' own ``from_pretrained`` with llmplug's registered quantizer (:mod:`llmplug.quant.hf_quantizer`),
so ``AutoModelForCausalLM.from_pretrained`` reads these checkpoints too. Weights are read and written with safetensors
only; remote code is never run.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, PreTrainedModel

from ..loading import load_causal_lm
from .hf_quantizer import QUANT_METHOD, LlmplugQuantConfig, permuted_modules, quantized_state_dict
from .quantize import QUANT_ATTR

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def save_quantized(model: PreTrainedModel, save_directory: str | os.PathLike, tokenizer=None,
                   max_shard_size: int | str = "5GB") -> None:
    """Write a model quantized by :func:`llmplug.quantize` (or loaded quantized) as a safetensors checkpoint.

    Args:
        model: an HF ``PreTrainedModel`` holding :class:`QuantLinear` layers, optimized or not (``save_pretrained``
            writes the per-module views of fused buffers as separate tensors). The model is left as it was.
        save_directory: created if missing; earlier weight shards in it are replaced.
        tokenizer: optional tokenizer (or processor) saved beside the model.
        max_shard_size: largest safetensors file before the weights are split into shards with an index.

    Raises:
        TypeError: ``model`` is not a transformers ``PreTrainedModel``.
        ValueError: the model was not quantized by llmplug.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"save_quantized needs a transformers PreTrainedModel, got {type(model).__name__}")
    record = model.__dict__.get(QUANT_ATTR)
    if record is None:
        raise ValueError("model is not quantized by llmplug; call llmplug.quantize(model, ...) before save_quantized")
    quant_config = LlmplugQuantConfig(method=record["method"], group_size=record["group_size"],
                                      modules=list(record["modules"]), permuted=permuted_modules(model))
    config = model.config
    had_config, previous = hasattr(config, "quantization_config"), getattr(config, "quantization_config", None)
    config.quantization_config = quant_config
    try:
        model.save_pretrained(save_directory, state_dict=quantized_state_dict(model), max_shard_size=max_shard_size)
    finally:
        if had_config:
            config.quantization_config = previous
        else:
            del config.quantization_config
    if tokenizer is not None:
        tokenizer.save_pretrained(save_directory)


def from_quantized(path: str | os.PathLike, device: str | torch.device | None = None,
                   dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Load a checkpoint written by :func:`save_quantized` (equivalent to ``AutoModelForCausalLM.from_pretrained``).

    The architecture is built on the meta device, the quantized linears are swapped for empty :class:`QuantLinear`
    of the right shapes, then the safetensors load into it: no full-precision copy of a quantized weight is made.

    Args:
        path: the checkpoint directory.
        device: where the weights load (``"cuda"``, ``"cpu"``, a ``torch.device``); CPU by default.
        dtype: dtype of the unquantized parameters, biases and int4 scales; the checkpoint's by default.

    Returns:
        The model in eval mode, with ``model._llmplug_quantization`` set as :func:`llmplug.quantize` sets it.

    Raises:
        FileNotFoundError: ``path`` is not a directory with ``config.json`` and safetensors weights.
        ValueError: the checkpoint is not llmplug-quantized, or its quantization config is invalid.
    """
    path = os.fspath(path)
    for names in (("config.json",), _WEIGHT_FILES):
        if not any(os.path.isfile(os.path.join(path, n)) for n in names):
            raise FileNotFoundError(f"{path!r} is not an llmplug checkpoint: it has none of {list(names)}")
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    quant = getattr(config, "quantization_config", None)
    quant_method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if quant_method != QUANT_METHOD:
        raise ValueError(f"{path!r} is not an llmplug checkpoint: its quantization_config quant_method is "
                         f"{quant_method!r}, expected {QUANT_METHOD!r}")
    return load_causal_lm(path, device, config=config, dtype=dtype or "auto", use_safetensors=True,
                          trust_remote_code=False)
