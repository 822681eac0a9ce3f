"""Programmatic edges into the cuBLAS kernels of a captured graph that wait on the grid dependency.

Captured under :func:`~llmplug.ops._triton.programmatic_launch`, llmplug's own kernels may start while their
predecessor finishes (each waits, ``griddepcontrol.wait``, before it reads activations). cuBLAS's kernels are captured
with default edges: each waits for its predecessor's end and a launch, ~1 us at every boundary next to a GEMM. Some
cuBLAS kernels wait on the grid dependency themselves and could take a programmatic edge; which ones is not
documented, so :class:`ProgrammaticGemms` finds out by a race at warm-up, per GEMM shape the graph runs: a kernel that
lets its dependents launch at once, then spins ~20k dependent steps before it writes the GEMM's input, followed by the
GEMM on a programmatic edge. A GEMM that waits reads the written input; one that does not reads zeros. Only kernels
that won the race (by function name and grid) get programmatic edges in the step graphs
(:meth:`ProgrammaticGemms.apply`, through the CUDA driver's graph API). A control that does not wait must lose the
race first, else nothing is changed. NOTE: H200, q/k/v and o at 128 rows wait, gate/up and down do not
(BENCHMARKS.md, "Fourth session of 2026-12-02").

``LLMPLUG_PDL=0`` or ``LLMPLUG_PDL_GEMMS=0`` in the environment keeps every graph's edges as captured.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Callable, Iterable

import torch

from ..ops._triton import HAS_GDC, programmatic_launch, tl, triton

_NODE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_EDGE_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
_PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC: the dependent may launch at the trigger
SPINS = 20_000  # the race's spin: ~50 us on an H200, against a GEMM's few-microsecond launch

KernelKey = tuple[str, tuple[int, int, int]]  # (function name, grid)


class _EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


_SYMBOLS = ("cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphKernelNodeGetParams_v2", "cuFuncGetName",
            "cuKernelGetName", "cuGraphGetEdges_v2", "cuGraphRemoveDependencies_v2", "cuGraphAddDependencies_v2")


class GraphApi:
    """The CUDA driver's graph calls this module needs (ctypes over ``libcuda``); raises ``OSError`` or
    ``AttributeError`` where the driver lacks them."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        for name in _SYMBOLS:
            getattr(self.lib, name).restype = ctypes.c_int

    def _call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} failed with CUresult {status}")

    def kernel_nodes(self, graph: int) -> dict[int, KernelKey]:
        """Kernel node handle -> ``(function name, grid)`` of every kernel node of the ``cudaGraph_t`` ``graph``."""
        count = ctypes.c_size_t(0)
        self._call("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(count))
        nodes = (ctypes.c_void_p * count.value)()
        self._call("cuGraphGetNodes", ctypes.c_void_p(graph), nodes, ctypes.byref(count))
        out = {}
        for node in nodes:
            kind = ctypes.c_int(-1)
            self._call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
            if kind.value != _NODE_KERNEL:
                continue
            params = _KernelParams()
            self._call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
            name = ctypes.c_char_p()
            if params.func:
                self._call("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(params.func))
            else:  # a library kernel
                self._call("cuKernelGetName", ctypes.byref(name), ctypes.c_void_p(params.kern))
            out[node] = (name.value.decode(), tuple(params.grid))
        return out

    def edges(self, graph: int) -> list[tuple[int, int, int]]:
        """``(from node, to node, dependency type)`` of every edge of ``graph``."""
        count = ctypes.c_size_t(0)
        self._call("cuGraphGetEdges_v2", ctypes.c_void_p(graph), None, None, None, ctypes.byref(count))
        n = count.value
        src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (_EdgeData * n)()
        self._call("cuGraphGetEdges_v2", ctypes.c_void_p(graph), src, dst, data, ctypes.byref(count))
        return [(src[i], dst[i], data[i].type) for i in range(n)]

    def make_programmatic(self, graph: int, kernels: dict[int, KernelKey], into: Callable[[int, int], bool]) -> int:
        """Turn every default edge ``a -> b`` between two of the kernel nodes ``kernels`` (:meth:`kernel_nodes`) of
        ``graph`` with ``into(a, b)`` programmatic; returns how many changed."""
        changed = 0
        for a, b, kind in self.edges(graph):
            if kind != 0 or a not in kernels or b not in kernels or not into(a, b):
                continue
            src, dst = (ctypes.c_void_p * 1)(a), (ctypes.c_void_p * 1)(b)
            self._call("cuGraphRemoveDependencies_v2", ctypes.c_void_p(graph), src, dst, ctypes.byref(_EdgeData()), 1)
            new = _EdgeData(_PORT_PROGRAMMATIC, 0, _EDGE_PROGRAMMATIC)
            self._call("cuGraphAddDependencies_v2", ctypes.c_void_p(graph), src, dst, ctypes.byref(new), 1)
            changed += 1
        return changed


if triton is not None and HAS_GDC:
    from triton.language.extra.cuda import gdc_launch_dependents

    @triton.jit
    def _spin_then_fill(x_ptr, n, spins, BLOCK: tl.constexpr):
        """Let dependents launch, spin ``spins`` dependent steps, then write ones into ``x[:n]``."""
        gdc_launch_dependents()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32) + offs.to(tl.float32)
        for _ in range(spins):
            acc = acc * 0.999 + 1.0
        tl.store(x_ptr + offs, tl.where(acc == -1.0, 2.0, 1.0).to(x_ptr.dtype.element_ty), mask=offs < n)

    @triton.jit
    def copy_no_wait(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        """``y[:n] = x[:n]`` without waiting on the grid dependency (the race's control)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def race(api: GraphApi, consumer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
         spins: int = SPINS) -> tuple[KernelKey | None, bool]:
    """Capture spin-then-fill ``x`` + ``consumer(x)`` (under programmatic launch), make the edge out of the spinning
    kernel programmatic, replay three times -> ``(the consumer's first kernel, whether every replay read the filled
    x)``; ``(None, False)`` when ``consumer`` launched no kernel."""
    want = consumer(torch.ones_like(x)).clone()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        _spin_then_fill[(triton.cdiv(x.numel(), 1024),)](x, x.numel(), spins, BLOCK=1024)
        with programmatic_launch():
            out = consumer(x)
    raw = graph.raw_cuda_graph()
    kernels = api.kernel_nodes(raw)
    spinner = next(node for node, (name, _) in kernels.items() if "spin_then_fill" in name)
    first = [b for a, b, _ in api.edges(raw) if a == spinner and b in kernels]
    if not first:
        return None, False
    api.make_programmatic(raw, kernels, lambda a, b: a == spinner)
    graph.instantiate()
    seen = []
    for _ in range(3):
        x.zero_()
        graph.replay()
        torch.cuda.synchronize(x.device)
        seen.append(bool(torch.equal(out, want)))
    return kernels[first[0]], all(seen)


def enabled() -> bool:
    """Whether step graphs get programmatic edges into waiting GEMMs (not under ``LLMPLUG_PDL=0`` or
    ``LLMPLUG_PDL_GEMMS=0``)."""
    return all(os.environ.get(var, "1") != "0" for var in ("LLMPLUG_PDL", "LLMPLUG_PDL_GEMMS"))


class ProgrammaticGemms:
    """Which GEMM kernels of one device wait on the grid dependency (found by :func:`race`, per GEMM shape, once),
    and the graphs' edges into them made programmatic (:meth:`apply`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.waits: dict[KernelKey, bool] = {}  # kernel -> whether it waited in every race it ran in
        self._raced: set[tuple] = set()  # (rows, N, K, dtype) raced already
        self.edges_changed = 0  # over every graph applied to
        self._api: GraphApi | None = None
        self.unsupported: str | None = None if torch.cuda.get_device_capability(device) >= (9, 0) else \
            "programmatic dependent launch needs compute capability 9.0"

    def verify(self, rows: int, linears: Iterable[tuple[tuple[int, int], Callable[[torch.Tensor], torch.Tensor]]],
               dtype: torch.dtype) -> None:
        """Race each ``((N, K), matmul)`` at ``rows`` rows of ``dtype`` input (``matmul: (rows, K) -> (rows, N)``, as
        the graph about to be captured calls it); the first call races the control first."""
        if self.unsupported is None and self._api is None:
            self._start()
        if self.unsupported is not None:
            return
        for (n, k), matmul in linears:
            if (rows, n, k, dtype) in self._raced:
                continue
            self._raced.add((rows, n, k, dtype))
            key, waited = race(self._api, matmul, torch.zeros(rows, k, dtype=dtype, device=self.device))
            if key is not None:
                self.waits[key] = self.waits.get(key, True) and waited

    def _start(self) -> None:
        if triton is None or not HAS_GDC:
            self.unsupported = "Triton with grid dependency control is needed for the race"
            return
        try:
            api = GraphApi()
            x = torch.zeros(4096, device=self.device)
            y = torch.empty_like(x)

            def copy(t: torch.Tensor) -> torch.Tensor:
                copy_no_wait[(triton.cdiv(t.numel(), 1024),)](t, y, t.numel(), BLOCK=1024)
                return y

            _, waited = race(api, copy, x)
        except (OSError, AttributeError, RuntimeError) as error:
            self.unsupported = f"the CUDA driver's graph API failed: {error}"
            warnings.warn(f"llmplug keeps cuBLAS's graph edges as captured ({self.unsupported})", stacklevel=3)
            return
        if waited:
            self.unsupported = "the race's control (a kernel that does not wait) read the filled input"
            warnings.warn(f"llmplug keeps cuBLAS's graph edges as captured ({self.unsupported})", stacklevel=3)
            return
        self._api = api

    def apply(self, graph: torch.cuda.CUDAGraph) -> int:
        """Make the default kernel-to-kernel edges of ``graph`` (captured with ``keep_graph=True``, not yet
        instantiated) into kernels that waited programmatic; returns how many changed."""
        if self._api is None:
            return 0
        raw = graph.raw_cuda_graph()
        kernels = self._api.kernel_nodes(raw)
        changed = self._api.make_programmatic(raw, kernels, lambda a, b: self.waits.get(kernels[b], False))
        self.edges_changed += changed
        return changed
