"""Shared plumbing for llmplug's Triton ops: availability, interpreter mode, launch wrapping.

Every op in ``llmplug/ops`` follows one pattern:

* a Triton kernel ``_<op>_kernel``;
* a pure-PyTorch reference ``<op>_ref`` (the CPU path, and the oracle in tests);
* a ``torch.library.triton_op`` named ``llmplug::<op>`` whose body launches the kernel when
  :func:`use_triton` says so and otherwise calls the reference.

Under ``TRITON_INTERPRET=1`` (set before ``triton`` is imported) the kernels run on CPU tensors through
Triton's interpreter; that is how CPU CI tests them.

Programmatic dependent launch (Hopper and later, :func:`pdl_options`): a decode step is a chain of ~300 short
kernels, and each one's launch, ramp-up and first weight reads would otherwise wait for its predecessor's tail. Kernels
that take a ``PDL`` constexpr call :func:`wait_inputs` before their first read of anything an earlier kernel wrote
(activations, KV pages, block tables) and before their first write; weights may be read before it, which is why PDL
is used only inside :func:`programmatic_launch` (model steps, whose weights no kernel writes).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - platforms without triton
    triton = None
    tl = None
    HAS_TRITON = False

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - Triton without grid dependency control
    HAS_GDC = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_cpu_kernels = [INTERPRET]
_PDL_CAPABLE: dict[int, bool] = {}
_pdl_scope = [False]

__all__ = ["HAS_TRITON", "INTERPRET", "InterpreterRequired", "call_op", "cpu_kernels", "llmplug_op", "maybe_wrap",
           "next_pow2", "pdl_options", "programmatic_launch", "round_rne", "rounded", "tl", "triton", "use_triton",
           "wait_inputs"]


class InterpreterRequired(RuntimeError):
    """Triton kernels were asked to run on CPU tensors without ``TRITON_INTERPRET=1`` set before triton's import."""


def llmplug_op(name: str, mutates_args: tuple[str, ...] | str = ()):
    """Decorator registering ``llmplug::<name>``.

    ``torch.library.triton_op`` (Inductor traces into the Triton launch) normally; under the interpreter an opaque
    ``torch.library.custom_op``, because interpreted kernels cannot run on the fake tensors tracing uses.
    """
    register = torch.library.custom_op if INTERPRET else torch.library.triton_op
    return register(f"llmplug::{name}", mutates_args=mutates_args)


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel (not the reference) should run on tensor ``t``'s device."""
    if not HAS_TRITON:
        return False
    if t.device.type == "cuda":
        return True
    return _cpu_kernels[-1] and t.device.type == "cpu"


@contextlib.contextmanager
def cpu_kernels(enabled: bool):
    """Run CPU tensors through the interpreted Triton kernels (``True``, needs ``TRITON_INTERPRET=1``) or the
    references (``False``) inside this block."""
    if enabled and not INTERPRET:
        raise InterpreterRequired("CPU kernels need TRITON_INTERPRET=1 set before triton is imported")
    _cpu_kernels.append(enabled)
    try:
        yield
    finally:
        _cpu_kernels.pop()


def check_out(out: torch.Tensor, like: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``out`` can take an op's result shaped like ``like``: same shape, dtype and device,
    unit stride on the last dim (a view into a larger buffer is fine)."""
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected {tuple(like.shape)} "
                         f"{like.dtype} on {like.device}")
    if out.shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"out needs a unit stride on its last dim, got strides {out.stride()}")


def call_op(op, *args):
    """Run a llmplug op: straight into its implementation in plain eager mode, through ``torch.ops`` otherwise.

    The dispatcher round trip costs ~10-20 us a call, which adds up over a prefill's few hundred op calls; under
    ``torch.compile`` or any dispatch mode (fake tensors, functionalization) the registered op is used as it must.
    """
    if torch.compiler.is_compiling() or _current_dispatch_mode() is not None:
        return op._opoverload(*args)
    return op._init_fn(*args)


def maybe_wrap(kernel):
    """``torch.library.wrap_triton(kernel)`` so Inductor can trace it; the bare kernel under the interpreter.

    ``wrap_triton`` rejects interpreted kernels, so under ``TRITON_INTERPRET=1`` the kernel is launched directly.
    """
    if INTERPRET:
        return kernel
    return torch.library.wrap_triton(kernel)


@contextlib.contextmanager
def programmatic_launch(enabled: bool = True):
    """Kernels launched inside may use programmatic dependent launch (see :func:`pdl_options`). For steps of a model
    whose weights stay fixed: the kernels read weights before the previous kernel has finished."""
    _pdl_scope.append(enabled)
    try:
        yield
    finally:
        _pdl_scope.pop()


def pdl_options(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel with a ``PDL`` constexpr working on ``t``'s device.

    ``{"PDL": True, "launch_pdl": True}`` inside :func:`programmatic_launch` on a CUDA device of compute capability
    9.0 or later in eager mode (CUDA-graph capture included), so the kernel may start while the previous kernel in the
    stream finishes; ``{"PDL": False}`` otherwise: outside that scope, the interpreter, older GPUs, Triton without grid
    dependency control, ``torch.compile`` tracing (Inductor launches the kernel itself) and ``LLMPLUG_PDL=0`` in the
    environment.
    """
    if not (_pdl_scope[-1] and HAS_GDC and t.is_cuda and not INTERPRET and os.environ.get("LLMPLUG_PDL", "1") != "0"):
        return {"PDL": False}
    if torch.compiler.is_compiling() or _current_dispatch_mode() is not None:
        return {"PDL": False}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _PDL_CAPABLE:
        _PDL_CAPABLE[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return {"PDL": True, "launch_pdl": True} if _PDL_CAPABLE[index] else {"PDL": False}


if triton is not None:

    @triton.jit
    def wait_inputs(PDL: tl.constexpr):
        """Under programmatic dependent launch: block until the previous kernel in the stream has finished and its
        writes are visible, then let the next kernel start launching. A no-op when ``PDL`` is false."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def round_rne(x, DTYPE: tl.constexpr):
        """fp32 ``x`` rounded to ``DTYPE`` (nearest even), kept in fp32: what the GPU's ``x.to(DTYPE)`` gives.

        For the interpreter, whose fp32 -> bf16 casts truncate and whose fp32 -> fp8 e4m3 casts lose the carry of a
        round-up; kernels call it only when interpreted. fp8: ``|x| <= 448`` (saturate first).
        """
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        elif DTYPE == tl.float8e4nv:
            # 3 mantissa bits from 2^-6 up; below, subnormals in steps of 2^-9 (adding 1.5 * 2^14 rounds to them)
            bits = x.to(tl.uint32, bitcast=True)
            normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
            tiny = (tl.abs(x) + 24576.0) - 24576.0
            tiny = tl.where((bits >> 31) != 0, -tiny, tiny)  # keeps the sign of a zero, as the GPU does
            return tl.where(tl.abs(x) < 0.015625, tiny, normal)
        else:
            return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def rounded(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
        """fp32 ``x`` rounded to ``DTYPE`` (nearest even) and kept in fp32: where an HF forward in ``DTYPE`` rounds an
        intermediate, a kernel computing in fp32 rounds there too (an identity for fp32)."""
        if INTERPRETED:
            return round_rne(x, DTYPE)
        return x.to(DTYPE).to(tl.float32)


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())
