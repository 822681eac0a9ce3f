"""Decode attention over a dense KV cache in Hugging Face's ``StaticCache`` layout, with a key mask.

What a compiled HF decode step's SDPA computes over its static cache (:mod:`llmplug.inductor.attention` puts it
there): one query token a sequence, ``k, v: (B, Hkv, L, D)`` and a boolean mask of the visible keys. The paged decode
kernel of :mod:`.decode_attention` runs it: each sequence's cache is one page of ``L`` tokens (``DENSE``, strided, no
block table) and the mask drops keys (``KEY_MASK``). The GQA expansion HF makes before SDPA is never materialised.
"""

from __future__ import annotations

import torch

from ._triton import call_op, llmplug_op, use_triton
from .decode_attention import QUERY_DTYPES, launch_decode_attention


def dense_decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                               scale: float) -> torch.Tensor:
    """Reference (plain PyTorch). ``q: (B, H, D)``, ``k, v: (B, Hkv, L, D)``, ``key_mask: (B, L)`` bool or None (every
    key visible) -> ``(B, H, D)`` in ``q.dtype``. Scores and softmax in fp32 (fp64 for fp64 inputs), ``p @ v`` in the
    input dtype, like the kernel; a row with no visible key comes out as zeros (SDPA gives NaN there)."""
    bsz, num_heads, head_dim = q.shape
    num_kv_heads, length = k.shape[1], k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    visible = torch.ones(bsz, length, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.bool()
    k, v = (torch.where(visible[:, None, :, None], t, 0) for t in (k, v))  # hidden keys are never read
    qg = q.reshape(bsz, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bkgd,bkld->bkgl", qg.to(acc), k.to(acc)) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.where(visible[:, None, None, :], torch.softmax(scores, dim=-1), 0)  # no visible key: NaN -> 0
    out = torch.einsum("bkgl,bkld->bkgd", probs.to(q.dtype), v)
    return out.reshape(bsz, num_heads, head_dim)


def kernel_layouts(q: torch.Tensor, key_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``q`` with a unit stride on D and ``key_mask`` as the kernel's ``uint8`` bytes (unit stride on L), copied once
    where a compiled graph handed other layouts (HF's are these already)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    mask = None if key_mask is None else key_mask.view(torch.uint8)  # bool bytes, read as 0 / 1
    return q, mask if mask is None or mask.stride(-1) == 1 else mask.contiguous()


@llmplug_op("dense_decode_attention")
def _dense_decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                               scale: float) -> torch.Tensor:
    if not use_triton(q):
        return dense_decode_attention_ref(q, k, v, key_mask, scale)
    # a compiled graph hands its tensors in the layouts Inductor chose: HF's are these already (q a row of heads, the
    # caches sharing strides, the mask's keys adjacent); anything else is copied once rather than refused
    q, mask = kernel_layouts(q, key_mask)
    if k.stride(-1) != 1 or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    # (B, Hkv, L, D) seen as one (L, Hkv, D) page a sequence: the kernel walks any strides
    return launch_decode_attention(q, k.transpose(1, 2), v.transpose(1, 2), None, None, scale, -1, 0.0, 0, None, None,
                                   key_mask=mask)


@_dense_decode_attention_op.register_fake
def _(q, k, v, key_mask, scale):
    return q.new_empty(q.shape)


def check_dense_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming the bad value unless :func:`dense_decode_attention` takes these inputs."""
    if q.dim() != 3 or k.dim() != 4:
        raise ValueError(f"q must be (B, H, D) and k, v (B, Hkv, L, D); got {tuple(q.shape)} and {tuple(k.shape)}")
    bsz, num_heads, head_dim = q.shape
    if v.shape != k.shape or k.shape[0] != bsz or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be ({bsz}, Hkv, L, {head_dim})")
    if num_heads % k.shape[1] != 0:
        raise ValueError(f"H={num_heads} query heads is not a multiple of Hkv={k.shape[1]} kv heads")
    if head_dim > 256:
        raise ValueError(f"head dim D={head_dim} > 256 is not supported")
    if q.dtype not in QUERY_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of {QUERY_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.stride() != v.stride() or k.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"k and v need one layout and q, k, v unit stride on D; got strides {q.stride()}, "
                         f"{k.stride()}, {v.stride()}")
    if key_mask is not None and (key_mask.dtype != torch.bool or key_mask.shape != (bsz, k.shape[2])
                                 or key_mask.stride(-1) != 1):
        raise ValueError(f"key_mask must be ({bsz}, {k.shape[2]}) bool with unit stride on L; got "
                         f"{tuple(key_mask.shape)} {key_mask.dtype} strides {key_mask.stride()}")


def dense_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """Attention of one new query token a sequence over a dense cache.

    Args:
        q: ``(B, H, D)`` fp16/bf16/fp32, unit stride on the last dim. ``D <= 256``.
        k, v: ``(B, Hkv, L, D)`` of ``q``'s dtype, one layout (any strides, unit on the last dim): HF's
            ``StaticCache`` tensors; query head ``h`` uses kv head ``h // (H // Hkv)``.
        key_mask: ``(B, L)`` bool, True where a key is visible (unit stride on ``L``; a broadcast batch stride 0 is
            fine); None: every key is.
        scale: softmax scale; None means ``D ** -0.5``.

    Returns:
        ``(B, H, D)`` in ``q.dtype``; a row with no visible key is zeros.
    """
    check_dense_inputs(q, k, v, key_mask)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return call_op(_dense_decode_attention_op, q, k, v, key_mask, scale)
