"""llmplug's quantization as a Hugging Face quantizer: ``from_pretrained`` loads llmplug checkpoints (and quantizes).

``import llmplug`` registers the quant method ``"llmplug"`` with transformers (:func:`register`), so that

    model = AutoModelForCausalLM.from_pretrained(saved_dir)          # written by llmplug.save_quantized
    model = AutoModelForCausalLM.from_pretrained(dense_dir, quantization_config=LlmplugQuantConfig("int4"))

load an llmplug-quantized checkpoint (the listed linears become empty :class:`QuantLinear` on the meta device
before the weights load, so no full-precision weight is ever allocated), or quantize a dense one as it loads (the
dense weights load first, then :func:`llmplug.quantize` runs on them: peak memory is the dense model's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from .linear import METHODS, QuantLinear
from .quantize import QUANT_ATTR, quantize

QUANT_METHOD = "llmplug"  # ``quant_method`` in a checkpoint's ``config.json``
GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class LlmplugQuantConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of an llmplug checkpoint, or the request to quantize a dense one on load.

    Args:
        method: ``"int8"``, ``"int4"`` or ``"fp8"`` (layouts in :mod:`llmplug.quant.formats`).
        group_size: int4 group width (32, 64, 128 or 256); ``None`` for the other methods (a value given is dropped).
        modules: names of the quantized linears (set by the checkpoint; ``None`` when quantizing on load).
        permuted: those of ``modules`` that gather their inputs by a stored permutation ``perm`` (act-order GPTQ
            imports, :mod:`llmplug.quant.import_4bit`).
        exclude: module-name patterns left unquantized when quantizing on load (as in :func:`llmplug.quantize`).
        quant_method: always ``"llmplug"`` (what transformers dispatches on).

    Raises:
        ValueError: an unknown method, group size or quant method (the message names the allowed ones).
    """

    method: str = "int8"
    group_size: int | None = 128
    modules: list[str] | None = None
    permuted: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=lambda: ["lm_head"])
    quant_method: str = field(default=QUANT_METHOD, kw_only=True)

    def __post_init__(self) -> None:
        if self.quant_method != QUANT_METHOD:
            raise ValueError(f"quant_method={self.quant_method!r} is not llmplug's; expected {QUANT_METHOD!r}")
        if self.method not in METHODS:
            raise ValueError(f"quantization_config method={self.method!r} is not supported; choose one of {METHODS}")
        if self.method == "int4" and self.group_size not in GROUP_SIZES:
            raise ValueError(f"quantization_config group_size={self.group_size!r} is not supported for int4; "
                             f"choose one of {GROUP_SIZES}")
        for name in ("modules", "permuted"):
            names = getattr(self, name)
            if names is not None:
                if not isinstance(names, (list, tuple)) or not all(isinstance(m, str) for m in names):
                    raise ValueError(f"quantization_config {name} must be a list of module names, got {names!r}")
                setattr(self, name, list(names))
        if self.method != "int4":
            self.group_size = None
        self.exclude = list(self.exclude)

    def to_dict(self) -> dict:
        """The JSON form; ``exclude`` only steers quantizing on load, a checkpoint's ``modules`` list replaces it."""
        out = super().to_dict()
        if self.modules is not None:
            del out["exclude"]
        return out


def _linears_to_replace(model: nn.Module, names: list[str]) -> list[tuple[str, str, nn.Linear]]:
    """``(checkpoint name, name in model, linear)`` for each checkpoint module name. Loading a causal-LM checkpoint
    into its base model (``AutoModel``) drops the base prefix and skips the head's linears; the converse adds it."""
    prefix = getattr(model, "base_model_prefix", "")
    is_base = bool(prefix) and getattr(model, "base_model", None) is model
    found = []
    for saved in names:
        name = saved
        if is_base and name.startswith(prefix + "."):
            name = name[len(prefix) + 1:]
        elif is_base:
            continue  # a head's linear (lm_head): not part of a base model
        elif prefix and not _has_submodule(model, name) and _has_submodule(model, f"{prefix}.{name}"):
            name = f"{prefix}.{name}"
        if not _has_submodule(model, name):
            raise ValueError(f"quantized module {name!r} of the checkpoint is not in {type(model).__name__}")
        module = model.get_submodule(name)
        if type(module) is not nn.Linear:
            raise ValueError(f"quantized module {name!r} of the checkpoint is a {type(module).__name__} in "
                             f"{type(model).__name__}, not an nn.Linear")
        found.append((saved, name, module))
    return found


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def replace_with_empty_quant_linears(model: nn.Module, config: LlmplugQuantConfig) -> list[str]:
    """Swap the linears ``config.modules`` names for uninitialized :class:`QuantLinear` of the same shapes, on the
    linears' device (meta while ``from_pretrained`` builds the model) and dtype; the weights are loaded later.

    A quantized linear has no ``weight`` to tie: ties naming one (a quantized ``lm_head`` of a model with tied
    embeddings) are dropped from ``model.all_tied_weights_keys``, and the embedding loads on its own.

    Returns:
        The replaced modules' names in ``model``.
    """
    replaced, permuted = {}, set(config.permuted)
    for saved, name, linear in _linears_to_replace(model, config.modules or []):
        device = linear.weight.device
        quant = QuantLinear(linear.in_features, linear.out_features, config.method, config.group_size or 128,
                            linear.bias is not None, linear.weight.dtype, device)
        if saved in permuted:
            quant.register_buffer("perm", torch.empty(linear.in_features, dtype=torch.int64, device=device))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, quant)
        replaced[f"{name}.weight"] = name
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in list(tied.items()):
        if target in replaced or source in replaced:
            del tied[target]
    return list(replaced.values())


def record_quantized(model: nn.Module, config: LlmplugQuantConfig, modules: list[str]) -> None:
    """Mark ``model`` as holding the quantized linears ``modules`` of ``config`` (what :func:`llmplug.quantize`
    records), for ``save_quantized`` and the checks that read it."""
    model.__dict__[QUANT_ATTR] = {"method": config.method, "group_size": config.group_size, "modules": modules}


def permuted_modules(model: nn.Module) -> list[str]:
    """Names of ``model``'s :class:`QuantLinear` that gather their inputs by a permutation ``perm``."""
    return [name for name, m in model.named_modules()
            if isinstance(m, QuantLinear) and getattr(m, "perm", None) is not None]


def quantized_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each ``perm`` copied: one permutation may serve several linears (q/k/v of an
    act-order import), and safetensors writes no aliases."""
    state = model.state_dict()
    for name in permuted_modules(model):
        state[f"{name}.perm"] = state[f"{name}.perm"].clone()
    return state


class LlmplugHfQuantizer(HfQuantizer):
    """Builds :class:`QuantLinear` skeletons for llmplug checkpoints, or quantizes dense weights after they load.

    Serializable (``save_pretrained`` writes the quantized buffers and this config), not trainable, compileable (the
    llmplug ops are ``torch.library`` ops with fake implementations).
    """

    requires_calibration = False
    quantization_config: LlmplugQuantConfig

    def __init__(self, quantization_config: LlmplugQuantConfig, **kwargs) -> None:
        super().__init__(quantization_config, **kwargs)
        if self.pre_quantized and quantization_config.modules is None:
            raise ValueError("llmplug checkpoint's quantization_config has no 'modules' list; was it written by "
                             "llmplug.save_quantized?")

    def _process_model_before_weight_loading(self, model, **kwargs):
        if self.pre_quantized:
            self._replaced = replace_with_empty_quant_linears(model, self.quantization_config)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        if self.pre_quantized:
            record_quantized(model, config, self._replaced)
            for module in model.modules():  # from_pretrained makes every float parameter trainable
                if isinstance(module, QuantLinear) and module.bias is not None:
                    module.bias.requires_grad_(False)
        else:
            quantize(model, config.method, config.group_size or 128, tuple(config.exclude))
            config.modules = list(model.__dict__[QUANT_ATTR]["modules"])
        return model

    def get_state_dict_and_metadata(self, model):
        """What ``save_pretrained`` writes: :func:`quantized_state_dict`, no extra safetensors metadata."""
        return quantized_state_dict(model), {}

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def register() -> None:
    """Add the quant method ``"llmplug"`` to transformers' quantizer and config registries (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(LlmplugQuantConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(LlmplugHfQuantizer)
