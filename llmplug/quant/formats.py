"""Weight layouts of llmplug's quantized linears, with the reference quantize / dequantize functions.

For ``W: (N, K)`` (out, in features):

* ``int8``: ``qweight (N, K) int8``, symmetric per output channel; ``scales (N,) float32``;
  ``W ~= qweight * scales[:, None]``.
* ``fp8``: ``qweight (N, K) float8_e4m3fn`` per output channel; ``scales (N,) float32``; same formula.
* ``int4``: groups of ``G`` consecutive input features share a scale and an integer zero point:
  ``W[n, k] ~= (q[n, k] - zeros[n, k // G]) * scales[n, k // G]`` with ``q`` in ``[0, 15]``;
  ``scales, zeros: (N, K // G)`` in the model dtype (zeros hold integers). Two values a byte:
  ``qweight (N, K // 2) uint8``; within each group the first ``G/2`` values sit in the low nibbles and the last
  ``G/2`` in the high nibbles of the group's ``G/2`` bytes, so a kernel reading one group gets two contiguous
  halves that pair with two contiguous slices of the activations.

Every format concatenates along ``N`` (fused q/k/v and gate/up weights are row concatenations).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight: (N, K)`` -> ``(qweight (N, K) int8, scales (N,) float32)``, round to nearest even."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(1e-12)
    q = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight: (N, K)`` -> ``(qweight (N, K) float8_e4m3fn, scales (N,) float32)``."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
    q = (w / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def dequantize_rowwise(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 / fp8 ``(N, K)`` and ``scales (N,)`` -> ``W (N, K)`` in ``dtype`` (products rounded once)."""
    return (qweight.float() * scales[:, None]).to(dtype)


def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """``q: (N, K)`` integers in ``[0, 15]`` -> ``(N, K // 2) uint8`` in the group-halves layout."""
    n, k = q.shape
    g = q.to(torch.uint8).view(n, k // group_size, 2, group_size // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``(N, K // 2) uint8`` -> ``(N, K) uint8``."""
    n, half = qweight.shape
    b = qweight.view(n, 2 * half // group_size, group_size // 2)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(n, 2 * half)


def _int4_codes(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype):
    """Quantize groups ``w: (R, NG, G)`` fp32 onto ``[0, 15]`` over ranges ``[lo, hi]`` (``(R, NG)``, containing 0).

    Returns ``(q, scales, zeros)`` with ``scales`` already rounded to ``dtype`` (the kernels read that scale)."""
    scales = ((hi - lo) / 15.0).clamp_min(1e-8).to(dtype).float()
    zeros = torch.round(-lo / scales).clamp_(0, 15)
    q = torch.round(w / scales[..., None] + zeros[..., None]).clamp_(0, 15)
    return q, scales, zeros


_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight: (N, K)`` -> ``(qweight (N, K//2) uint8, scales (N, K//G), zeros (N, K//G))``, asymmetric.

    Each group's range ``[min, max]`` (widened to include 0, so zero stays exact) maps onto ``[0, 15]`` with an
    integer zero point; the range is shrunk by whichever of a few clipping ratios gives the least squared error
    (about +1 dB SQNR on Gaussian weights). Scales and zeros take ``weight.dtype``. Rows are done in chunks to
    bound the temporary memory.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features={k} is not a multiple of group_size={group_size}")
    packed, all_scales, all_zeros = [], [], []
    for w in weight.split(max(1, (1 << 22) // k)):
        w = w.float().view(w.shape[0], k // group_size, group_size)
        lo, hi = w.amin(dim=2).clamp_max(0.0), w.amax(dim=2).clamp_min(0.0)
        best = None
        for ratio in _CLIP_RATIOS:
            q, scales, zeros = _int4_codes(w, lo * ratio, hi * ratio, weight.dtype)
            err = ((q - zeros[..., None]) * scales[..., None] - w).pow(2).sum(dim=2)
            if best is None:
                best = [q, scales, zeros, err]
            else:
                better = err < best[3]
                for i, new in enumerate((q, scales, zeros, err)):
                    best[i] = torch.where(better[..., None] if new.dim() == 3 else better, new, best[i])
        q, scales, zeros, _ = best
        packed.append(pack_int4(q.view(w.shape[0], k), group_size))
        all_scales.append(scales.to(weight.dtype))
        all_zeros.append(zeros.to(weight.dtype))
    return torch.cat(packed), torch.cat(all_scales), torch.cat(all_zeros)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """``(N, K//2) uint8`` with ``scales, zeros (N, K//G)`` -> ``W (N, K)`` in ``dtype``."""
    q = unpack_int4(qweight, group_size).float()
    n, k = q.shape
    w = (q.view(n, -1, group_size) - zeros.float()[..., None]) * scales.float()[..., None]
    return w.view(n, k).to(dtype)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(|ref|^2 / |ref - approx|^2)`` in dB."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise.clamp_min(1e-300)))
