"""``llmplug.quantize(model, ...)``: replace a model's ``nn.Linear`` layers by :class:`QuantLinear` in place."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

import torch.nn as nn
from tqdm.auto import tqdm

from .linear import METHODS, QuantLinear

QUANT_ATTR = "_llmplug_quantization"  # on the model: what quantize did


def _excluded(name: str, patterns: tuple[str, ...]) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(last, p) for p in patterns)


def quantize(model: nn.Module, method: str = "int8", group_size: int = 128, exclude: tuple[str, ...] = ("lm_head",),
             filter: Callable[[str, nn.Linear], bool] | None = None) -> nn.Module:
    """Quantize the weights of ``model``'s linear layers in place (lossy: the original weights are freed).

    Args:
        model: any ``nn.Module`` (an HF causal LM on its device and dtype, typically).
        method: ``"int8"`` (per output channel), ``"int4"`` (groups of ``group_size`` inputs with scales and zero
            points) or ``"fp8"`` (e4m3 per output channel; activations per token on GPUs with FP8 tensor cores).
        group_size: int4 group width (32, 64, 128 or 256); linears whose input width it does not divide stay as
            they are.
        exclude: module-name patterns (``fnmatch``, tried on the full name and its last part) left unquantized;
            ``lm_head`` by default. Embeddings are never ``nn.Linear`` and are never touched.
        filter: optional ``filter(name, linear) -> bool``; only linears it accepts are quantized.

    Returns:
        ``model``, with a record of what was done in ``model._llmplug_quantization``
        (``{"method", "group_size", "modules": [names]}``).

    Raises:
        ValueError: an unknown method or group size, or a model quantized before with different settings.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not supported; choose one of {METHODS}")
    if group_size not in (32, 64, 128, 256):
        raise ValueError(f"group_size={group_size!r} is not supported; choose one of (32, 64, 128, 256)")
    record = {"method": method, "group_size": group_size if method == "int4" else None, "modules": []}
    done = model.__dict__.get(QUANT_ATTR)
    if done is not None and (done["method"], done["group_size"]) != (record["method"], record["group_size"]):
        raise ValueError(f"model is already quantized as {done['method']}; reload it to quantize differently")
    targets = [
        (name, mod) for name, mod in model.named_modules()
        if type(mod) is nn.Linear and not _excluded(name, tuple(exclude)) and (filter is None or filter(name, mod))
        and (method != "int4" or mod.in_features % group_size == 0)
    ]
    for name, linear in tqdm(targets, desc=f"llmplug: quantizing to {method}", leave=False,
                             disable=len(targets) < 32 or None):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear.from_linear(linear, method, group_size))
        record["modules"].append(name)
    if done is not None:
        record["modules"] = done["modules"] + record["modules"]
    model.__dict__[QUANT_ATTR] = record
    return model
