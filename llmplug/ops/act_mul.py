"""Gated activations: ``act(x[..., :N]) * x[..., N:]`` for SiLU (Llama, Qwen, Mistral, Phi-3) and GELU-tanh (Gemma).

The MLP's fused gate/up projection produces ``gu: (T, 2N)``; this op turns it into ``(T, N)`` in one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import (
    INTERPRET,
    call_op,
    llmplug_op,
    maybe_wrap,
    next_pow2,
    pdl_options,
    rounded,
    tl,
    triton,
    use_triton,
    wait_inputs,
)

ACTIVATIONS = ("silu", "gelu_tanh")


def act_and_mul_ref(gu: torch.Tensor, activation: str) -> torch.Tensor:
    """Reference. ``gu: (T, 2N)`` -> ``(T, N)`` in ``gu.dtype``; math in fp32, rounded where HF's MLP rounds:
    ``act(gate)`` to ``gu.dtype``, then the product."""
    n = gu.shape[-1] // 2
    gate, up = gu[..., :n].float(), gu[..., n:].float()
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return (act.to(gu.dtype).float() * up).to(gu.dtype)


if triton is not None:

    @triton.jit
    def gated_act(gate, up, ACT: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
        """``act(gate) * up`` in fp32 for fp32 ``gate, up`` (SiLU or GELU(tanh)), ``act(gate)`` rounded to ``DTYPE``
        first as HF's MLP (``act_fn(gate_proj(x)) * up_proj(x)`` in the model dtype) rounds it."""
        if ACT == "silu":
            act = gate / (1.0 + tl.exp(-gate))
        else:  # gelu_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
            act = 0.5 * gate * (1.0 + tanh)
        return rounded(act, DTYPE, INTERPRETED) * up

    @triton.jit
    def store_gated(out_ptr, y, start, n_out, BLOCK_N: tl.constexpr, ACT: tl.constexpr, INTERPRETED: tl.constexpr):
        """Epilogue of a matrix-vector product over a fused gate/up weight whose ``BLOCK_N`` rows are ``BLOCK_N / 2``
        gate rows then the matching up rows: ``out[start + i] = act(gate[i]) * up[i]``, with gate and up first rounded
        to the output dtype, so the result equals a separate ``act_and_mul`` over the product's output, bit for bit.
        ``y: (BLOCK_N,)`` fp32."""
        HALF: tl.constexpr = BLOCK_N // 2
        gate, up = tl.split(tl.trans(tl.reshape(y, (2, HALF))))
        dt = out_ptr.dtype.element_ty
        out = gated_act(rounded(gate, dt, INTERPRETED), rounded(up, dt, INTERPRETED), ACT, dt, INTERPRETED)
        out = rounded(out, dt, INTERPRETED)
        cols = start + tl.arange(0, HALF)
        tl.store(out_ptr + cols, out.to(dt), mask=cols < n_out)

    @triton.jit
    def _act_and_mul_kernel(gu_ptr, out_ptr, N, stride_gu, stride_out, ACT: tl.constexpr, BLOCK: tl.constexpr,
                            INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        wait_inputs(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * stride_gu + N + cols, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        out = rounded(gated_act(gate, up, ACT, dt, INTERPRETED), dt, INTERPRETED)
        tl.store(out_ptr + row * stride_out + cols, out.to(dt), mask=mask)


@llmplug_op("act_and_mul")
def _act_and_mul_op(gu: torch.Tensor, activation: str) -> torch.Tensor:
    if not use_triton(gu):
        return act_and_mul_ref(gu, activation)
    assert gu.dim() == 2 and gu.stride(-1) == 1, "gu must be (T, 2N) with unit stride on the last dim"
    rows, n = gu.shape[0], gu.shape[1] // 2
    out = gu.new_empty((rows, n))
    if rows == 0:
        return out
    block = min(1024, next_pow2(n))
    grid = (rows, triton.cdiv(n, block))
    maybe_wrap(_act_and_mul_kernel)[grid](gu, out, n, gu.stride(0), out.stride(0), ACT=activation, BLOCK=block,
                                           INTERPRETED=INTERPRET, **pdl_options(gu))
    return out


@_act_and_mul_op.register_fake
def _(gu, activation):
    return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))


def act_and_mul(gu: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` for ``gu = cat([gate, up], -1)``.

    Args:
        gu: ``(..., 2N)`` bf16/fp16/fp32, last dim contiguous.
        activation: ``"silu"`` or ``"gelu_tanh"``.

    Returns:
        ``(..., N)`` in ``gu.dtype``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; choose one of {ACTIVATIONS}")
    lead = gu.shape[:-1]
    out = call_op(_act_and_mul_op, gu.reshape(-1, gu.shape[-1]), activation)
    return out.view(*lead, -1)


def check_gated(gated: str, rows: int) -> None:
    """Validate a fused gate/up epilogue request: ``gated`` is ``""`` or one of :data:`ACTIVATIONS`, and a gated
    weight has an even number of ``rows`` (gate rows, then up rows)."""
    if gated and (gated not in ACTIVATIONS or rows % 2):
        raise ValueError(f"gated={gated!r} needs one of {ACTIVATIONS} and an even number of rows (gate then up), "
                         f"got {rows}")


def maybe_gated(y: torch.Tensor, gated: str) -> torch.Tensor:
    """``act_and_mul(y, gated)`` for a gated product (``gated`` an activation), else ``y`` itself."""
    return act_and_mul(y, gated) if gated else y
