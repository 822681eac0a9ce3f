"""The quantized KV cache format (fp8 e4m3 or int8 pages with fp32 scales), shared by the store and attention ops.

Layout, per layer: ``k_cache, v_cache: (num_blocks, P, Hkv, D)`` in ``torch.float8_e4m3fn`` or ``torch.int8``, and
``k_scale, v_scale: (num_blocks, Hkv, P)`` fp32: one scale per token and kv head, the ``P`` tokens of a page side by
side for each head, so an attention tile reads the scales of its tokens as one short contiguous run per page.

A stored row ``x`` (the ``D`` values of one token's kv head) becomes ``scale = max(absmax(x), AMAX_FLOOR) / QMAX``
and ``q = clamp(x / scale, -QMAX, QMAX)`` rounded to the storage type (fp8: to nearest even, ``QMAX = 448``; int8:
to nearest with ties away from zero, ``QMAX = 127``); it reads back as ``q * scale``. Kernels and references divide
with IEEE rounding (``tl.div_rn``), so they store bit-identical values and scales.
"""

from __future__ import annotations

import torch

from ._triton import round_rne, tl, triton

QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
AMAX_FLOOR = 1e-30  # an all-zero row gets a tiny positive scale (no 0 / 0) and stores zeros

__all__ = ["AMAX_FLOOR", "QMAX", "check_scales", "dequantize_ref", "is_quantized", "quantize_ref", "read_pages_ref"]


def is_quantized(dtype: torch.dtype) -> bool:
    """True for the KV storage dtypes that carry scales (fp8 e4m3, int8)."""
    return dtype in QMAX


def quantize_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: (..., D)`` float -> ``(q (..., D) dtype, scale (...) fp32)`` with one scale per row of ``D``."""
    qmax = QMAX[dtype]
    xf = x.float()
    amax = xf.abs().amax(-1).clamp_min(AMAX_FLOOR)
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its rounded reciprocal, not as IEEE division
    scale = amax / torch.full_like(amax, qmax)
    y = (xf / scale[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return y.to(dtype), scale


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q: (..., D)`` fp8/int8, ``scale: (...)`` fp32 -> ``q * scale`` in ``dtype`` (computed in fp32, or fp64)."""
    acc = torch.promote_types(dtype, torch.float32)
    return (q.to(acc) * scale.to(acc)[..., None]).to(dtype)


def read_pages_ref(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor, offsets: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Rows ``cache[blocks, offsets]``: ``(..., Hkv, D)`` for index tensors of one shape ``(...)``.

    Args:
        cache: ``(num_blocks, P, Hkv, D)``.
        scale: ``(num_blocks, Hkv, P)`` fp32 for an fp8/int8 cache (the rows come back dequantized, as ``dtype``);
            None for a plain cache (the rows come back as stored).
        blocks, offsets: int64 block ids and in-page offsets.
        dtype: the dequantized rows' dtype.
    """
    slots = blocks * cache.shape[1] + offsets
    # NOTE: index_select, not cache[blocks, offsets]: the same rows, without an OpenMP region per call on short contexts
    # (BENCHMARKS.md, "CPU threads beside a busy neighbour")
    rows = cache.view(-1, *cache.shape[2:]).index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[2:])
    if scale is None:
        return rows
    return dequantize_ref(rows, scale[blocks, :, offsets], dtype)


def check_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless fp8/int8 caches come with fp32 ``(num_blocks, Hkv, P)`` contiguous scales and
    other caches with none."""
    if not is_quantized(k_cache.dtype):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are only for fp8/int8 caches, got a {k_cache.dtype} cache")
        return
    num_blocks, page, num_kv_heads, _ = k_cache.shape
    want = (num_blocks, num_kv_heads, page)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"a {k_cache.dtype} cache needs {name} of shape (num_blocks, Hkv, P) = {want}")
        if tuple(s.shape) != want or s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 of shape (num_blocks, Hkv, P) = {want}, got "
                             f"{s.dtype} of shape {tuple(s.shape)}")
        if s.device != k_cache.device:
            raise ValueError(f"{name} is on {s.device}, the cache on {k_cache.device}")


if triton is not None:
    _FLOOR = tl.constexpr(AMAX_FLOOR)

    @triton.jit
    def quantize_rows(x, QMAX_: tl.constexpr, IS_INT: tl.constexpr, INTERPRETED: tl.constexpr):
        """``x: (R, BLOCK_D)`` fp32 (padding lanes 0) -> ``(y, scale)``: ``y (R, BLOCK_D)`` fp32 values on the
        storage grid (cast them with ``.to``), ``scale (R,)`` fp32. Matches :func:`quantize_ref` bit for bit."""
        amax = tl.maximum(tl.max(tl.abs(x), 1), _FLOOR)
        scale = tl.div_rn(amax, tl.full(amax.shape, QMAX_, tl.float32))
        y = tl.div_rn(x, scale[:, None])
        y = tl.minimum(tl.maximum(y, -QMAX_), QMAX_)
        if IS_INT:
            y = tl.where(y < 0, -1.0, 1.0) * tl.floor(tl.abs(y) + 0.5)
        elif INTERPRETED:
            y = round_rne(y, tl.float8e4nv)
        return y, scale

    @triton.jit
    def tile_v_scales(v_scale):
        """``v_scale: (BLOCK_N,)`` fp32 V scales of an attention tile's tokens (0 where masked) -> ``(ratio, v_max)``:
        ``ratio = v_scale / v_max`` in ``[0, 1]`` and the scalar ``v_max``, so ``(p * ratio) @ v * v_max`` is
        ``p @ (v * v_scale)`` with ``p * ratio`` as well scaled as ``p`` for an fp16/bf16 matmul operand."""
        v_max = tl.maximum(tl.max(v_scale, 0), 1e-37)
        return v_scale * (1.0 / v_max), v_max
