"""``QuantLinear``: an ``nn.Linear`` stand-in holding quantized weights, and the kernel choice per token count."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..ops.act_mul import act_and_mul
from ..ops.fp8_linear import fp8_linear, scaled_mm_supported
from ..ops.w4_linear import uses_gemv, w4_linear, w4_linear_add_norm
from ..ops.w8_linear import w8_linear, w8_linear_add_norm
from .formats import dequantize_int4, dequantize_rowwise, quantize_fp8, quantize_int4, quantize_int8

METHODS = ("int8", "int4", "fp8")

# Token count from which fp8 runs on FP8 tensor cores (activations quantized per token), not the weight-only kernel.
# NOTE: scaled_mm wins at 64 tokens, not at 32 (H100, 2026-11-22; BENCHMARKS.md, "Figures moved from code comments")
FP8_GEMM_MIN_TOKENS = 64


class QuantLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` stored quantized (layouts in :mod:`llmplug.quant.formats`).

    Buffers: ``qweight`` (int8 / float8_e4m3fn ``(N, K)``, or uint8 ``(N, K // 2)`` for int4), ``scales``
    (``(N,)`` float32, or ``(N, K // G)`` for int4) and, for int4, ``zeros`` ``(N, K // G)``. ``bias`` stays a
    parameter in the model dtype. ``perm`` (``(K,)`` int64, or None) gathers the input features first,
    ``x[:, perm]``: act-order GPTQ checkpoints store their groups in that order (:mod:`llmplug.quant.import_4bit`).
    Works under the stock HF forward and llmplug's fused one alike.
    """

    def __init__(self, in_features: int, out_features: int, method: str, group_size: int = 128, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method={method!r} is not supported; choose one of {METHODS}")
        if method == "int4" and (in_features % group_size or group_size % 2):
            raise ValueError(f"in_features={in_features} is not a multiple of group_size={group_size}")
        self.in_features, self.out_features = in_features, out_features
        self.method, self.group_size, self.dtype = method, group_size if method == "int4" else 0, dtype
        n, k = out_features, in_features
        if method == "int4":
            self.register_buffer("qweight", torch.empty((n, k // 2), dtype=torch.uint8, device=device))
            self.register_buffer("scales", torch.empty((n, k // group_size), dtype=dtype, device=device))
            self.register_buffer("zeros", torch.empty((n, k // group_size), dtype=dtype, device=device))
        else:
            qdtype = torch.int8 if method == "int8" else torch.float8_e4m3fn
            self.register_buffer("qweight", torch.empty((n, k), dtype=qdtype, device=device))
            self.register_buffer("scales", torch.empty((n,), dtype=torch.float32, device=device))
        self.register_buffer("perm", None)
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: str, group_size: int = 128) -> QuantLinear:
        """Quantize ``linear``'s weight (the original module is left as it is)."""
        w = linear.weight.detach()
        q = cls(linear.in_features, linear.out_features, method, group_size, linear.bias is not None, w.dtype,
                w.device)
        if method == "int8":
            q.qweight, q.scales = quantize_int8(w)
        elif method == "fp8":
            q.qweight, q.scales = quantize_fp8(w)
        else:
            q.qweight, q.scales, q.zeros = quantize_int4(w, group_size)
        if linear.bias is not None:
            q.bias.data.copy_(linear.bias.detach())
        return q

    def matmul(self, x: torch.Tensor, rstd_parts: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        """``x: (M, K)`` -> ``(M, N)``; the kernel is chosen by ``M``. ``rstd_parts, eps``: ``x`` is the first half
        of an RMSNorm (:meth:`matmul_add_norm`), finished here (one token, :meth:`norm_gemv`)."""
        x = self._permuted(x)
        if self.method == "int4":
            return w4_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias,
                             rstd_parts=rstd_parts, eps=eps)
        if self._fp8_gemm(x):
            return fp8_linear(x, self.qweight, self.scales, self.bias)
        return w8_linear(x, self.qweight, self.scales, self.bias, rstd_parts=rstd_parts, eps=eps)

    def gated_matmul(self, x: torch.Tensor, activation: str, rstd_parts: torch.Tensor | None = None,
                     eps: float = 0.0) -> torch.Tensor:
        """``act(x @ W_gate^T) * (x @ W_up^T)`` for a fused gate/up module (gate rows first): ``x: (M, K)`` ->
        ``(M, N / 2)``; ``rstd_parts, eps`` as :meth:`matmul`. The weight-only kernels apply it in the one-token
        GEMV's epilogue. NOTE: applied to the down projection's input instead, it cost more than it saved (H100, 8B
        down projection, int8 30.8 us fused against 23.3 + ~3 us): every program re-read and re-activated the whole
        gate/up row."""
        if self.method == "int4":
            return w4_linear(self._permuted(x), self.qweight, self.scales, self.zeros, self.group_size, self.bias,
                             gated=activation, rstd_parts=rstd_parts, eps=eps)
        if self._fp8_gemm(x):
            return act_and_mul(self.matmul(x), activation)
        return w8_linear(self._permuted(x), self.qweight, self.scales, self.bias, gated=activation,
                         rstd_parts=rstd_parts, eps=eps)

    def norm_gemv(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (one token on CUDA) runs on a GEMV that can end a decoder's residual add and start its next
        RMSNorm (:meth:`matmul_add_norm`) or finish one (``rstd_parts``): int8 and fp8 weights, int4 where it takes
        the GEMV."""
        if x.shape[0] != 1 or not x.is_cuda:
            return False
        if self.method == "int4":
            return uses_gemv(x, self.qweight, self.scales, self.zeros, self.group_size)
        return True

    def matmul_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        offset: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token: ``residual_out = x @ W^T + b + residual`` and the first half of the RMSNorm after it, as
        :func:`~llmplug.ops.w8_linear.w8_linear_add_norm` (int4: ``w4_linear_add_norm``): ``(out, residual_out,
        parts)``; the next module's ``matmul(out, rstd_parts=parts, eps=...)`` finishes the norm."""
        if self.method == "int4":
            return w4_linear_add_norm(self._permuted(x), self.qweight, self.scales, self.zeros, self.group_size,
                                      self.bias, residual, norm_weight, offset)
        return w8_linear_add_norm(self._permuted(x), self.qweight, self.scales, self.bias, residual, norm_weight,
                                  offset)

    def _permuted(self, x: torch.Tensor) -> torch.Tensor:
        """``x[:, perm]`` for act-order checkpoints, else ``x``."""
        return x if self.perm is None else x.index_select(1, self.perm)

    def _fp8_gemm(self, x: torch.Tensor) -> bool:
        """Whether this fp8 module runs ``x`` on FP8 tensor cores (enough rows, bf16, 16-aligned, supported GPU)."""
        n, k = self.qweight.shape
        return (self.method == "fp8" and x.shape[0] >= FP8_GEMM_MIN_TOKENS and x.dtype == torch.bfloat16
                and n % 16 == 0 and k % 16 == 0 and scaled_mm_supported(x.device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``(N, K)`` weight this module multiplies its input by (``perm`` undone), in ``dtype``."""
        if self.method == "int4":
            w = dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, dtype)
        else:
            w = dequantize_rowwise(self.qweight, self.scales, dtype)
        if self.perm is not None:  # the module computes x[:, perm] @ w^T
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (..., K)`` -> ``(..., N)``."""
        return self.matmul(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.method == "int4" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}{group}, " \
               f"bias={self.bias is not None}"


def fuse_quant_linears(mods: list[QuantLinear], log) -> QuantLinear:
    """One ``QuantLinear`` whose rows are ``mods``' rows (fused q/k/v or gate/up); each module's buffers become
    views of the fused ones, so no memory is duplicated. ``log`` (an ``UndoLog``) gives them their own copies back.
    Input permutations (``perm``) must be equal; the fused module shares it.
    """
    first = mods[0]
    if any((m.method, m.group_size, m.in_features) != (first.method, first.group_size, first.in_features)
           for m in mods):
        raise ValueError("only QuantLinears of one method, group size and input width can be fused")
    if any((m.perm is None) != (first.perm is None) or (m.perm is not None and not torch.equal(m.perm, first.perm))
           for m in mods):
        raise NotImplementedError("cannot fuse QuantLinears whose inputs are permuted differently (act-order "
                                  "checkpoints with different g_idx across q/k/v or gate/up)")
    has_bias = first.bias is not None
    fused = QuantLinear(first.in_features, sum(m.out_features for m in mods), first.method, first.group_size or 128,
                        has_bias, first.dtype, first.qweight.device)
    rows = [name for name in fused._buffers if name != "perm"]
    fused.perm = first.perm
    for name in rows:
        whole = torch.cat([getattr(m, name) for m in mods])
        setattr(fused, name, whole)
        start = 0
        for m in mods:
            setattr(m, name, whole[start:start + m.out_features])
            start += m.out_features
    if has_bias:
        fused.bias = nn.Parameter(log.fuse_parameters([m.bias for m in mods]), requires_grad=False)

    def undo():
        for m in mods:
            for name in rows:
                setattr(m, name, getattr(m, name).clone())

    log.record(undo)
    return fused
