"""llmplug: make Hugging Face transformers models generate as fast as dedicated inference engines, in place.

    model = llmplug.optimize(model)
    out = model.generate(**inputs, max_new_tokens=256)
    llmplug.unoptimize(model)
    model = llmplug.optimize(model, quantize="int4")           # int8 / int4 / fp8 weights, fp8 / int8 KV cache
    llmplug.save_quantized(model, "out/")                      # safetensors; llmplug.from_quantized("out/") or
                                                               # AutoModelForCausalLM.from_pretrained("out/")

    engine = llmplug.Engine(model, tokenizer=tokenizer)        # continuous batching
    outputs = engine.generate(prompts, llmplug.SamplingParams(max_new_tokens=128))
"""

from .api import is_optimized, optimize, unoptimize
from .config import OptimizeConfig
from .engine.engine import Engine
from .engine.params import EngineConfig, SamplingParams
from .engine.request import CompletionOutput, RequestOutput, StreamDelta
from .engine.scoring import logits
from .errors import KVCacheFullError, UnsupportedModelError
from .quant import LlmplugQuantConfig, QuantLinear, from_gptq_awq, from_quantized, quantize, save_quantized

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "KVCacheFullError", "LlmplugQuantConfig", "OptimizeConfig",
           "QuantLinear", "RequestOutput", "SamplingParams", "StreamDelta", "UnsupportedModelError", "from_gptq_awq",
           "from_quantized", "is_optimized", "logits", "optimize", "quantize", "save_quantized", "unoptimize"]
__version__ = "0.1.0"
