"""llmplug: make Hugging Face transformers models generate as fast as dedicated inference engines, in place.

    model = llmplug.optimize(model)
    out = model.generate(**inputs, max_new_tokens=256)
    llmplug.unoptimize(model)
"""

from .api import is_optimized, optimize, unoptimize
from .config import OptimizeConfig
from .errors import KVCacheFullError, UnsupportedModelError

__all__ = ["KVCacheFullError", "OptimizeConfig", "UnsupportedModelError", "is_optimized", "optimize", "unoptimize"]
__version__ = "0.1.0"
