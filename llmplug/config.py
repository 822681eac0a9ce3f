"""``OptimizeConfig``: every knob of ``llmplug.optimize``, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["OptimizeConfig"]

_BLOCK_SIZES = (8, 16, 32, 64, 128)
QUANT_METHODS = ("int8", "int4", "fp8")
GROUP_SIZES = (32, 64, 128, 256)
KV_CACHE_DTYPES = ("auto", "fp8", "int8")


@dataclass(frozen=True)
class OptimizeConfig:
    """Settings for :func:`llmplug.optimize`. Unknown keys and bad values raise, naming the allowed ones.

    Attributes:
        fuse: apply the model family's fused kernels (RMSNorm, RoPE, fused q/k/v and gate/up GEMMs); families
            without a patch run through ``transformers.AttentionInterface`` only.
        kv_block_size: tokens per KV page.
        kv_num_blocks: pages in the KV pool; ``None`` sizes the pool from ``kv_memory_fraction``.
        kv_memory_fraction: share of the device's free memory (after weights) given to the KV pool on CUDA;
            on CPU, the share of physical memory. ``None``: 0.6 on CUDA; on CPU a pool of 1 GiB (131k tokens of
            the 8-layer ``models/llmplug-stdlib-small`` in fp32), not a share of a machine's RAM that other
            processes use too.
        cuda_graphs: replay CUDA graphs for decode steps (CUDA only).
        gemm_tuning: before capturing a graph of 9-256 tokens, time cuBLASLt's candidate algorithms for the fused
            families' bf16/fp16 GEMMs at that size and run the fastest (:mod:`llmplug.ops.tuned_gemm`; CUDA only).
            Off by default: ~0.5 s more a graph size at warm-up for ~1% (a 1B model's decode-heavy serving on an
            H200), and which algorithm wins can differ between processes, and with it the last bits of results.
        graph_batch_sizes: batch-size buckets captured for decode; larger batches run eagerly.
        graph_prefill_tokens: token buckets captured for single-sequence prefill chunks; others run eagerly.
        packed_graph_tokens: token buckets of the graphs (:mod:`llmplug.engine.packed_graphs`) that other packed
            steps (prompt chunks, mixed with decodes) replay, attention included (CUDA, graphs on); captured by
            ``Engine.warmup`` up to its step budget; ``()`` runs those steps eagerly.
        max_prefill_tokens: prompt tokens packed into one forward pass; longer prompts are chunked.
        max_model_len: longest sequence (prompt + new tokens); ``None`` takes the model config's
            ``max_position_embeddings``.
        quantize: weight quantization of the linear layers: ``None`` (off), ``"int8"`` (per output channel),
            ``"int4"`` (groups of ``group_size`` along the input, scales and zero points) or ``"fp8"`` (e4m3 weights
            per output channel, activations per token). Lossy, and kept by ``unoptimize``.
        group_size: input features per int4 scale/zero group.
        quantize_exclude: module-name patterns (``fnmatch``, matched against the full name and its last part)
            whose linears stay unquantized; embeddings are never quantized.
        kv_cache_dtype: KV pool storage: ``"auto"`` (the model's dtype), ``"fp8"`` (e4m3) or ``"int8"``, with a
            scale per token and KV head.
        tensor_parallel: split the model over the ranks of ``torch.distributed`` (:mod:`llmplug.parallel`):
            ``None`` or 1 (one process), ``"auto"`` (the world size when ``torch.distributed`` is initialised, as
            under ``torchrun``), or the world size itself. Every rank must call ``optimize`` and then run the same
            ``generate`` / engine calls.
    """

    fuse: bool = True
    kv_block_size: int = 16
    kv_num_blocks: int | None = None
    kv_memory_fraction: float | None = None
    cuda_graphs: bool = True
    gemm_tuning: bool = False
    graph_batch_sizes: tuple[int, ...] = field(default=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256))
    graph_prefill_tokens: tuple[int, ...] = field(default=(64, 128, 256, 512))
    packed_graph_tokens: tuple[int, ...] = field(default=(128, 256, 512, 1024, 2048, 4096, 8192))
    max_prefill_tokens: int = 8192
    max_model_len: int | None = None
    quantize: str | None = None
    group_size: int = 128
    quantize_exclude: tuple[str, ...] = field(default=("lm_head",))
    kv_cache_dtype: str = "auto"
    tensor_parallel: int | str | None = None

    def __post_init__(self) -> None:
        for name in ("fuse", "cuda_graphs", "gemm_tuning"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.kv_block_size not in _BLOCK_SIZES:
            raise ValueError(f"kv_block_size={self.kv_block_size!r} is not supported; choose one of {_BLOCK_SIZES}")
        if self.kv_num_blocks is not None and (not isinstance(self.kv_num_blocks, int) or self.kv_num_blocks < 1):
            raise ValueError(f"kv_num_blocks={self.kv_num_blocks!r} must be a positive int or None")
        fraction = self.kv_memory_fraction
        if fraction is not None and not (isinstance(fraction, (int, float)) and 0.0 < fraction < 1.0):
            raise ValueError(f"kv_memory_fraction={fraction!r} must be a float in (0, 1) or None")
        for name in ("graph_batch_sizes", "graph_prefill_tokens", "packed_graph_tokens"):
            sizes = tuple(getattr(self, name))
            if any(not isinstance(b, int) or b < 1 for b in sizes):
                raise ValueError(f"{name}={getattr(self, name)!r} must be positive ints")
            object.__setattr__(self, name, tuple(sorted(set(sizes))))
        if not isinstance(self.max_prefill_tokens, int) or self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens!r} must be a positive int")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive int or None")
        if self.quantize is not None and self.quantize not in QUANT_METHODS:
            raise ValueError(f"quantize={self.quantize!r} is not supported; choose None or one of {QUANT_METHODS}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size!r} is not supported; choose one of {GROUP_SIZES}")
        if isinstance(self.quantize_exclude, str) or any(not isinstance(p, str) for p in self.quantize_exclude):
            raise ValueError(f"quantize_exclude={self.quantize_exclude!r} must be a tuple of name patterns")
        object.__setattr__(self, "quantize_exclude", tuple(self.quantize_exclude))
        tp = self.tensor_parallel
        if not (tp is None or tp == "auto" or (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1)):
            raise ValueError(f"tensor_parallel={tp!r} must be None, 'auto' or a positive int (the world size)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose from {KV_CACHE_DTYPES}")

    @classmethod
    def from_overrides(cls, config: OptimizeConfig | None = None, **overrides) -> OptimizeConfig:
        """``config`` (or the defaults) with ``overrides`` applied; unknown keys raise ``TypeError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown llmplug option(s) {unknown}; allowed: {sorted(known)}")
        base = config if config is not None else cls()
        if not isinstance(base, cls):
            raise TypeError(f"config must be an OptimizeConfig, got {type(base).__name__}")
        return dataclasses.replace(base, **overrides)
