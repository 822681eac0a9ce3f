"""Quantized linears (int8, int4, fp8), their layouts, ``quantize(model)``, and safetensors checkpoints.

Importing this registers the quant method ``"llmplug"`` with transformers (``from_pretrained`` then loads llmplug
checkpoints); nothing else process-wide changes.
"""

from .checkpoint import from_quantized, save_quantized
from .hf_quantizer import LlmplugQuantConfig, register
from .import_4bit import awq_linear, from_gptq_awq, gptq_linear
from .linear import METHODS, QuantLinear
from .quantize import quantize

register()

__all__ = ["METHODS", "LlmplugQuantConfig", "QuantLinear", "awq_linear", "from_gptq_awq", "from_quantized",
           "gptq_linear", "quantize", "save_quantized"]
