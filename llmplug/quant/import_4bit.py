"""Import GPTQ and AWQ 4-bit checkpoints by repacking them into llmplug's int4 layout (:mod:`.formats`).

On-disk layouts, for ``W: (N, K)`` (out, in features), group size ``G``, ``NG = K // G`` groups; "value ``i``" of an
int32 word is ``word >> 4i & 15``:

* GPTQ (AutoGPTQ, GPTQModel, optimum; ``quant_method: "gptq"``): ``qweight (K // 8, N) int32`` packs 8 values
  along K (``q[8r + i, n]`` is value ``i`` of ``qweight[r, n]``); ``qzeros (NG, N // 8) int32`` packs 8 values
  along N; ``scales (NG, N) fp16``; ``g_idx (K,) int32`` is the group of each input feature, ``k // G`` unless
  the checkpoint was quantized in activation order (``desc_act``). ``W[n, k] = (q[k, n] - z[g, n]) * s[g, n]`` with
  ``g = g_idx[k]``, where ``z`` is the stored value plus one in the classic ``checkpoint_format: "gptq"`` (v1:
  AutoGPTQ stores ``zero - 1``; like AutoGPTQ's readers we add one per value after masking, so a stored 15 reads
  as 16, which llmplug's float zero points keep) and the stored value itself in ``"gptq_v2"``.
* AWQ (AutoAWQ ``version: "gemm"``; ``quant_method: "awq"``): ``qweight (K, N // 8) int32`` packs 8 values along N
  in the interleaved order ``q[k, 8c + AWQ_ORDER[i]]`` = value ``i`` of ``qweight[k, c]``; ``qzeros (NG, N // 8)``
  likewise; ``scales (NG, N) fp16``; ``W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]``.

Act-order GPTQ groups are scattered over K; a stable sort of K by ``g_idx`` makes each group contiguous, and the
resulting :class:`QuantLinear` gathers its input by that permutation (``perm``) before the kernel. Source groups
larger than llmplug's largest (``group_size: -1`` is one group of K) are split into equal groups that repeat the
scale and zero point. The repacked weight equals the source's dequantised weight exactly when the scales are
representable in the model dtype (fp16 scales: exact in fp16 and fp32, rounded once in bf16).
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch
import torch.nn as nn

from .formats import pack_int4
from .linear import QuantLinear
from .quantize import QUANT_ATTR

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # value i of an AWQ word is column AWQ_ORDER[i] of its 8
_AWQ_COLUMNS = tuple(sorted(range(8), key=AWQ_ORDER.__getitem__))  # column p of 8 is value _AWQ_COLUMNS[p]
KERNEL_GROUPS = (256, 128, 64, 32)
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm",)


def _unpack_words(words: torch.Tensor) -> torch.Tensor:
    """``words: (R, C) int32`` -> ``(R, C, 8) uint8``; ``[..., i]`` is value ``i`` (bits ``4i .. 4i + 3``)."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed tensors must be int32 (8 values a word), got {words.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 15).to(torch.uint8)


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {shape}, got {tuple(t.shape)}")


def _act_order_perm(g_idx: torch.Tensor, num_groups: int, group: int) -> torch.Tensor | None:
    """``g_idx (K,)`` -> the stable sort of K by group (``(K,)`` int64), or None when it is already sorted.

    Raises ValueError unless every group holds exactly ``group`` features (then the sorted groups are contiguous).
    """
    g_idx = g_idx.long()
    if g_idx.min() < 0 or g_idx.max() >= num_groups:
        raise ValueError(f"g_idx values must lie in [0, {num_groups}), got [{int(g_idx.min())}, {int(g_idx.max())}]")
    counts = torch.bincount(g_idx, minlength=num_groups)
    if (counts != group).any():
        raise ValueError(f"g_idx must give every group {group} input features, got counts {counts.tolist()}")
    perm = torch.sort(g_idx, stable=True).indices
    return None if torch.equal(perm, torch.arange(len(perm), device=perm.device)) else perm


def kernel_group_size(source_group: int) -> int:
    """The llmplug group size a source group of ``source_group`` input features splits into: the largest of
    :data:`KERNEL_GROUPS` dividing it."""
    for group in KERNEL_GROUPS:
        if source_group % group == 0:
            return group
    raise ValueError(f"groups of {source_group} input features are not supported; llmplug's int4 kernels take "
                     f"groups of {KERNEL_GROUPS[::-1]} or multiples of them")


def _quant_linear(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, perm: torch.Tensor | None,
                  bias: torch.Tensor | None, dtype: torch.dtype, kernel_group: int | None) -> QuantLinear:
    """Repack codes ``q (K, N)`` uint8 with ``zeros, scales (NG, N)``, groups of ``K // NG`` along ``K`` permuted by
    ``perm``; each source group becomes equal llmplug groups of ``kernel_group`` (default the largest that fit)."""
    k, n = q.shape
    source_group = k // zeros.shape[0]
    group = kernel_group or kernel_group_size(source_group)
    if group not in KERNEL_GROUPS or source_group % group:
        raise ValueError(f"kernel_group={kernel_group} must be one of {KERNEL_GROUPS[::-1]} and divide the source "
                         f"group of {source_group}")
    repeat = source_group // group
    if perm is not None:
        q = q.index_select(0, perm)
    linear = QuantLinear(k, n, "int4", group, bias is not None, dtype, "meta")
    linear.qweight = pack_int4(q.t().contiguous(), group)
    linear.scales = scales.t().to(dtype).repeat_interleave(repeat, dim=1).contiguous()
    linear.zeros = zeros.t().to(dtype).repeat_interleave(repeat, dim=1).contiguous()
    linear.perm = perm
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return linear


def gptq_linear(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, *, group_size: int, checkpoint_format: str = "gptq",
                dtype: torch.dtype = torch.bfloat16, kernel_group: int | None = None) -> QuantLinear:
    """One GPTQ 4-bit linear as an llmplug int4 :class:`QuantLinear` (on ``qweight``'s device).

    Args:
        qweight: ``(K // 8, N)`` int32, 8 values along K a word.
        qzeros: ``(NG, N // 8)`` int32, 8 values along N a word (``NG = K // group_size``).
        scales: ``(NG, N)`` (fp16 on disk).
        g_idx: ``(K,)`` group of each input feature; None means ``k // group_size``. Act-order ``g_idx`` become the
            module's input permutation ``perm``.
        bias: optional ``(N,)``.
        group_size: the checkpoint's group size (``-1``: one group over K).
        checkpoint_format: ``"gptq"`` (v1: stored zero points are ``zero - 1``) or ``"gptq_v2"``.
        dtype: the model dtype (scales, zero points, bias).
        kernel_group: llmplug's group size (it must divide the source group); default the largest that does.

    Raises:
        ValueError: a bad shape, dtype, format or group size, or ``g_idx`` whose groups are not all of one size.
    """
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"checkpoint_format={checkpoint_format!r} is not supported; choose one of {GPTQ_FORMATS}")
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    num_groups = scales.shape[0]
    group = k if group_size == -1 else group_size
    if group <= 0 or num_groups * group != k:
        raise ValueError(f"group_size={group_size} does not fit K={k} input features with {num_groups} groups of "
                         "scales")
    _check_shape("scales", scales, (num_groups, n))
    _check_shape("qzeros", qzeros, (num_groups, n // 8))
    q = _unpack_words(qweight).permute(0, 2, 1).reshape(k, n)
    zeros = _unpack_words(qzeros).reshape(num_groups, n).float()
    if checkpoint_format == "gptq":
        zeros += 1
    perm = None
    if g_idx is not None:
        _check_shape("g_idx", g_idx, (k,))
        perm = _act_order_perm(g_idx, num_groups, group)
    return _quant_linear(q, zeros, scales, perm, bias, dtype, kernel_group)


def awq_linear(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
               *, group_size: int, dtype: torch.dtype = torch.bfloat16, kernel_group: int | None = None) -> QuantLinear:
    """One AutoAWQ GEMM-format 4-bit linear as an llmplug int4 :class:`QuantLinear` (on ``qweight``'s device).

    Args:
        qweight: ``(K, N // 8)`` int32, 8 values along N a word in :data:`AWQ_ORDER`.
        qzeros: ``(NG, N // 8)`` int32, same order (``NG = K // group_size``).
        scales: ``(NG, N)`` (fp16 on disk).
        bias: optional ``(N,)``.
        group_size: the checkpoint's group size (``-1``: one group over K).
        dtype: the model dtype (scales, zero points, bias).
        kernel_group: llmplug's group size (it must divide the source group); default the largest that does.

    Raises:
        ValueError: a bad shape, dtype or group size.
    """
    k, n = qweight.shape[0], 8 * qweight.shape[1]
    group = k if group_size == -1 else group_size
    if group <= 0 or k % group:
        raise ValueError(f"group_size={group_size} does not divide K={k}")
    _check_shape("scales", scales, (k // group, n))
    _check_shape("qzeros", qzeros, (k // group, n // 8))
    columns = list(_AWQ_COLUMNS)
    q = _unpack_words(qweight)[..., columns].reshape(k, n)
    zeros = _unpack_words(qzeros)[..., columns].reshape(k // group, n).float()
    return _quant_linear(q, zeros, scales, None, bias, dtype, kernel_group)


def _read_quant_config(path: Path) -> dict:
    """The checkpoint's quantization settings, normalised to ``{"method", "group_size", "format"}``."""
    config = json.loads((path / "config.json").read_text())
    qc = config.get("quantization_config")
    if qc is None and (path / "quantize_config.json").exists():  # AutoGPTQ's own file
        qc = {"quant_method": "gptq", **json.loads((path / "quantize_config.json").read_text())}
    if qc is None and (path / "quant_config.json").exists():  # AutoAWQ's own file
        qc = {"quant_method": "awq", **json.loads((path / "quant_config.json").read_text())}
    if qc is None:
        raise ValueError(f"{path} has no quantization_config in config.json (nor quantize_config.json)")
    method = str(qc.get("quant_method", qc.get("method", ""))).lower()
    bits = qc.get("bits", qc.get("w_bit"))
    if method not in ("gptq", "awq"):
        raise ValueError(f"quant_method={method!r} is not supported; choose 'gptq' or 'awq'")
    if bits != 4:
        raise ValueError(f"bits={bits!r} is not supported; llmplug imports 4-bit GPTQ and AWQ checkpoints only")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if qc.get("is_marlin_format") or fmt not in GPTQ_FORMATS:
            fmt = "marlin" if qc.get("is_marlin_format") else fmt
            raise ValueError(f"GPTQ checkpoint_format={fmt!r} is not supported; choose one of {GPTQ_FORMATS}")
        if qc.get("pack_dtype", "int32") != "int32":
            raise ValueError(f"GPTQ pack_dtype={qc['pack_dtype']!r} is not supported; only 'int32'")
    else:
        fmt = str(qc.get("version", qc.get("format", "gemm"))).lower()
        if fmt not in AWQ_VERSIONS:
            raise ValueError(f"AWQ version={fmt!r} is not supported; choose one of {AWQ_VERSIONS} (AutoAWQ GEMM)")
        if qc.get("backend", "autoawq") != "autoawq":
            raise ValueError(f"AWQ backend={qc['backend']!r} is not supported; only 'autoawq' packing")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ zero_point=False is not supported; only asymmetric AWQ with zero points")
    return {"method": method, "group_size": group_size, "format": fmt}


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters registered inside go to the meta device (no memory); buffers (RoPE tables) are built for real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _tensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no .safetensors files (pickled .bin checkpoints are not read)")
    return files


def _swap_quantized(model: nn.Module, take, prefixes: list[str], qc: dict, dtype: torch.dtype) -> int:
    """Replace the linears at ``prefixes`` by repacked :class:`QuantLinear` (tensors from ``take(key)``); returns
    the llmplug group size, one for the whole model (``group_size: -1`` splits every K into the same groups)."""
    if not prefixes:
        raise ValueError("the checkpoint holds no quantized linears (no '.qweight' tensors)")
    linears = {prefix: model.get_submodule(prefix) for prefix in prefixes}
    for prefix, dense in linears.items():
        if type(dense) is not nn.Linear:
            raise ValueError(f"{prefix} is quantized in the checkpoint but is a {type(dense).__name__} in the model; "
                             "only nn.Linear layers can be imported")
    source = qc["group_size"]
    group = kernel_group_size(math.gcd(*(m.in_features for m in linears.values())) if source == -1 else source)
    for prefix, dense in linears.items():
        parts = {name: take(f"{prefix}.{name}") for name in ("qweight", "qzeros", "scales", "g_idx", "bias")}
        if parts["qzeros"] is None or parts["scales"] is None:
            raise ValueError(f"{prefix} has a qweight but no qzeros/scales")
        if qc["method"] == "gptq":
            linear = gptq_linear(parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"], parts["bias"],
                                 group_size=source, checkpoint_format=qc["format"], dtype=dtype, kernel_group=group)
        else:
            linear = awq_linear(parts["qweight"], parts["qzeros"], parts["scales"], parts["bias"], group_size=source,
                                dtype=dtype, kernel_group=group)
        if (linear.in_features, linear.out_features) != (dense.in_features, dense.out_features):
            raise ValueError(f"{prefix}: checkpoint is {linear.in_features} -> {linear.out_features} features, the "
                             f"model's linear {dense.in_features} -> {dense.out_features}")
        parent_name, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent_name), child, linear)
    return group


def _load_dense(model: nn.Module, take, keys: list[str]) -> None:
    """Load the checkpoint's other tensors into ``model``'s parameters and buffers, cast to their dtypes."""
    for key in keys:
        module_name, _, name = key.rpartition(".")
        if name == "inv_freq":  # old checkpoints saved RoPE tables that the model computes
            continue
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            module = None
        current = getattr(module, name, None)
        if not isinstance(current, torch.Tensor):
            raise ValueError(f"checkpoint tensor {key} has no place in {type(model).__name__}")
        value = take(key)
        _check_shape(key, value, tuple(current.shape))
        value = value.to(current.dtype)
        if isinstance(current, nn.Parameter):
            setattr(module, name, nn.Parameter(value, requires_grad=current.requires_grad))
        else:
            module._buffers[name] = value


def from_gptq_awq(path: str | Path, device: torch.device | str | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Load a local GPTQ or AWQ 4-bit HF checkpoint as a causal LM whose quantized linears are llmplug int4.

    The architecture comes from ``config.json`` (never remote code), built without allocating the dense weights;
    each linear stored as ``qweight``/``qzeros``/``scales`` (``g_idx``) is repacked into a :class:`QuantLinear`,
    every other tensor is loaded as it is (cast to ``dtype``). Tensors are read straight onto ``device``.

    Args:
        path: checkpoint directory: ``config.json`` with ``quantization_config`` (``quant_method`` ``"gptq"`` or
            ``"awq"``, ``bits: 4``, ``group_size``; GPTQ ``checkpoint_format`` ``"gptq"`` (default) or
            ``"gptq_v2"``; AWQ ``version: "gemm"``), or AutoGPTQ's ``quantize_config.json`` / AutoAWQ's
            ``quant_config.json`` beside it, and ``*.safetensors`` weights.
        device: where the model goes (default CPU).
        dtype: the model dtype; fp16 scales are rounded to it.

    Returns:
        The model in eval mode; ``optimize`` it as any other. Its config no longer claims the source quantization
        (the weights are in llmplug's layout); ``model._llmplug_quantization`` records the import as
        :func:`llmplug.quantize` records its work (``group_size`` is llmplug's), plus ``"source"``.

    Raises:
        ValueError: unsupported quantization settings (named, with the supported ones), or tensors missing from or
            unknown to the architecture.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    device = torch.device(device or "cpu")
    qc = _read_quant_config(path)
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)

    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(f, framework="pt", device=str(device))) for f in _tensor_files(path)]
        where = {key: f for f in files for key in f.keys()}

        def take(key: str) -> torch.Tensor | None:
            f = where.pop(key, None)
            return None if f is None else f.get_tensor(key)

        prefixes = sorted(key[: -len(".qweight")] for key in where if key.endswith(".qweight"))
        group = _swap_quantized(model, take, prefixes, qc, dtype)
        _load_dense(model, take, list(where))

    model.tie_weights()
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ValueError(f"checkpoint misses {len(missing)} tensors: {missing[:5]}")
    model.__dict__[QUANT_ATTR] = {"method": "int4", "group_size": group, "modules": prefixes,
                                  "source": f"{qc['method']}:{qc['format']}"}
    return model.to(device).eval()
