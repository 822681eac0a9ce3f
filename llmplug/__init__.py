"""llmplug: make Hugging Face transformers models generate as fast as dedicated inference engines, in place.

    model = llmplug.optimize(model)
    out = model.generate(**inputs, max_new_tokens=256)
    llmplug.unoptimize(model)
    model = llmplug.optimize(model, quantize="int4")           # int8 / int4 / fp8 weights, fp8 / int8 KV cache

    engine = llmplug.Engine(model, tokenizer=tokenizer)        # continuous batching
    outputs = engine.generate(prompts, llmplug.SamplingParams(max_new_tokens=128))
"""

from .api import is_optimized, optimize, unoptimize
from .config import OptimizeConfig
from .engine.engine import Engine
from .engine.params import EngineConfig, SamplingParams
from .engine.request import CompletionOutput, RequestOutput, StreamDelta
from .errors import KVCacheFullError, UnsupportedModelError
from .quant import QuantLinear, quantize

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "KVCacheFullError", "OptimizeConfig", "QuantLinear",
           "RequestOutput", "SamplingParams", "StreamDelta", "UnsupportedModelError", "is_optimized", "optimize",
           "quantize", "unoptimize"]
__version__ = "0.1.0"
