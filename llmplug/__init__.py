"""llmplug: make Hugging Face transformers models generate as fast as dedicated inference engines, in place.

    model = llmplug.optimize(model)
    out = model.generate(**inputs, max_new_tokens=256)
    llmplug.unoptimize(model)
    model = llmplug.optimize(model, quantize="int4")           # int8 / int4 / fp8 weights, fp8 / int8 KV cache
    llmplug.save_quantized(model, "out/")                      # safetensors; llmplug.from_quantized("out/") or
                                                               # AutoModelForCausalLM.from_pretrained("out/")

    out = model.generate(**inputs, prompt_lookup_num_tokens=4)  # speculative, any batch size (or assistant_model=)
    head = llmplug.load_eagle3("head_dir/", model)             # an EAGLE-3 head in the reference format
    out = model.generate(**inputs, assistant_model=head, num_assistant_tokens=5)
    llmplug.spec_stats(model)                                  # its acceptance rate and tokens a step

    engine = llmplug.Engine(model, tokenizer=tokenizer)        # continuous batching
    outputs = engine.generate(prompts, llmplug.SamplingParams(max_new_tokens=128))
"""

from .api import is_optimized, optimize, unoptimize
from .config import OptimizeConfig
from .engine.engine import Engine
from .engine.params import EngineConfig, SamplingParams, SpeculativeConfig
from .engine.request import CompletionOutput, RequestOutput, StreamDelta
from .engine.scoring import logits
from .errors import KVCacheFullError, UnsupportedModelError
from .parallel.load import load_split
from .quant import LlmplugQuantConfig, QuantLinear, from_gptq_awq, from_quantized, quantize, save_quantized
from .spec.eagle3 import load_eagle3
from .spec.stats import spec_stats

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "KVCacheFullError", "LlmplugQuantConfig", "OptimizeConfig",
           "QuantLinear", "RequestOutput", "SamplingParams", "SpeculativeConfig", "StreamDelta",
           "UnsupportedModelError", "from_gptq_awq", "from_quantized", "is_optimized", "load_eagle3", "load_split",
           "logits", "optimize", "quantize", "save_quantized", "spec_stats", "unoptimize"]
__version__ = "0.1.0"
