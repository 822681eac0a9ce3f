"""Gated activations: ``act(gate) * up`` for SiLU (Llama, Qwen, Mistral, Phi-3) and GELU-tanh (Gemma).

The MLP's fused gate/up projection produces ``gu: (T, 2N)``, which :func:`act_and_mul` turns into ``(T, N)`` in one
pass; :func:`act_mul` takes the halves as two tensors (separate projections, as a compiled HF graph has them).
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


def act_mul_ref(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """Reference. ``gate, up: (..., N)`` -> ``(..., N)`` in their dtype; math in fp32, rounded where HF's MLP rounds:
    ``act(gate)`` to the dtype, then the product."""
    g = gate.float()
    act = F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")
    return (act.to(gate.dtype).float() * up.float()).to(gate.dtype)


def act_and_mul_ref(gu: torch.Tensor, activation: str) -> torch.Tensor:
    """Reference. ``gu: (T, 2N)`` -> ``(T, N)``: :func:`act_mul_ref` of its halves."""
    n = gu.shape[-1] // 2
    return act_mul_ref(gu[..., :n], gu[..., n:], activation)


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
    def _act_mul_kernel(gate_ptr, up_ptr, out_ptr, N, stride_gate, stride_up, stride_out, ACT: tl.constexpr,
                        BLOCK: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        wait_inputs(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        out = rounded(gated_act(gate, up, ACT, dt, INTERPRETED), dt, INTERPRETED)
        tl.store(out_ptr + row * stride_out + cols, out.to(dt), mask=mask)


@llmplug_op("act_mul")
def _act_mul_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if not use_triton(gate):
        return act_mul_ref(gate, up, activation)
    n = gate.shape[-1]
    out = gate.new_empty(gate.shape)
    rows = out.numel() // n if n else 0
    if rows == 0:
        return out
    gate, up = (t.reshape(rows, n) if t.stride(-1) == 1 else t.contiguous().view(rows, n) for t in (gate, up))
    block = min(1024, next_pow2(n))
    grid = (rows, triton.cdiv(n, block))
    maybe_wrap(_act_mul_kernel)[grid](gate, up, out, n, gate.stride(0), up.stride(0), n, ACT=activation,
                                       BLOCK=block, INTERPRETED=INTERPRET, **pdl_options(gate))
    return out


@_act_mul_op.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up``, rounded where HF's MLP rounds (``act(gate)`` to the dtype first).

    Args:
        gate, up: ``(..., N)`` of one shape and dtype (bf16/fp16/fp32).
        activation: ``"silu"`` or ``"gelu_tanh"``.

    Returns:
        ``(..., N)`` in their dtype.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; choose one of {ACTIVATIONS}")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    return call_op(_act_mul_op, gate, up, activation)


def act_and_mul(gu: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` for ``gu = cat([gate, up], -1)``.

    Args:
        gu: ``(..., 2N)`` bf16/fp16/fp32, last dim contiguous.
        activation: ``"silu"`` or ``"gelu_tanh"``.

    Returns:
        ``(..., N)`` in ``gu.dtype``.
    """
    n = gu.shape[-1] // 2
    return act_mul(gu[..., :n], gu[..., n:], activation)


def check_gated(gated: str, rows: int) -> None:
    """Validate a fused gate/up epilogue request: ``gated`` is ``""`` or one of :data:`ACTIVATIONS`, and a gated
    weight has an even number of ``rows`` (gate rows, then up rows)."""
    if gated and (gated not in ACTIVATIONS or rows % 2):
        raise ValueError(f"gated={gated!r} needs one of {ACTIVATIONS} and an even number of rows (gate then up), "
                         f"got {rows}")


def maybe_gated(y: torch.Tensor, gated: str) -> torch.Tensor:
    """``act_and_mul(y, gated)`` for a gated product (``gated`` an activation), else ``y`` itself."""
    return act_and_mul(y, gated) if gated else y
