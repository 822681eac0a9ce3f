"""Quantized linears (int8, int4, fp8), their layouts, and ``quantize(model)``."""

from .linear import METHODS, QuantLinear
from .quantize import quantize

__all__ = ["METHODS", "QuantLinear", "quantize"]
