"""Loading a local HF checkpoint onto a device, with or without ``accelerate``."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import is_accelerate_available

__all__ = ["load_causal_lm"]


def load_causal_lm(path: str | os.PathLike, device: str | torch.device | None = None, **kwargs) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` on ``device``, in eval mode.

    With ``accelerate`` installed the weights load straight onto ``device`` (``device_map``); without it they load on
    the CPU and move, since transformers 5.24 refuses any ``device_map`` without ``accelerate``. ``device=None``
    leaves the model where transformers puts it.
    """
    if device is not None and is_accelerate_available():
        return AutoModelForCausalLM.from_pretrained(path, device_map=device, **kwargs).eval()
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return (model if device is None else model.to(device)).eval()
