"""A small ctypes binding to cuBLASLt: the matmul ``y = x @ W^T`` with a chosen algorithm.

``torch.nn.functional.linear`` runs the first algorithm cuBLAS's heuristic names; at a serving step's 64-256 rows
that choice leaves narrow weights read at a third to a half of the memory's rate. This module lists the heuristic's
other candidates (and their split-K variants) so a caller can time them and run the fastest. It talks to the
``libcublasLt`` that torch already loaded (found in ``/proc/self/maps``), so no new dependency is involved.

Layouts follow cuBLAS's column-major view of row-major tensors: ``y^T (N, M) = W (N, K) x^T (K, M)``, with ``W``
transposed (``TRANSA = T``) and ``x`` as is.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch

__all__ = ["REDUCTIONS", "Algo", "LtMatmul", "available"]

_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F = 0  # cudaDataType CUDA_R_32F
_DTYPES = {torch.bfloat16: 14, torch.float16: 2}  # CUDA_R_16BF, CUDA_R_16F
_DESC_TRANSA, _DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
_PREF_MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
_CFG = {"tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6, "cluster": 8}
_SIZE4, _SIZE8 = ctypes.c_size_t(4), ctypes.c_size_t(8)  # attribute sizes: size_t parameters, passed as such
REDUCTIONS = (1, 2, 4)  # split-K reductions: INPLACE (ordered, through counters), COMPUTE_TYPE, OUTPUT_TYPE


class _AlgoStruct(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _AlgoStruct), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclasses.dataclass(frozen=True)
class Algo:
    """One cuBLASLt algorithm for one problem: its opaque bytes, the workspace it needs and its configuration
    (tile id, split-K count, reduction scheme, ...; cuBLASLt's enum values) for reports."""

    data: tuple[int, ...]
    workspace: int
    config: tuple[tuple[str, int], ...]

    def struct(self) -> _AlgoStruct:
        return _AlgoStruct((ctypes.c_uint64 * 8)(*self.data))


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """The ``libcublasLt`` torch loaded (a cuBLASLt matmul is run first to load it), or None."""
    if not torch.cuda.is_available():
        return None
    previous = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        x = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda")
        torch.nn.functional.linear(x, x)
        torch.cuda.synchronize()
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libcublasLt.so" in line]
    return ctypes.CDLL(paths[0]) if paths else None


def available() -> bool:
    """True when a CUDA device is present and torch's cuBLASLt library could be found."""
    return _lib() is not None


@functools.cache
def _handle() -> ctypes.c_void_p:
    """The process's cuBLASLt handle (a handle carries no device: one serves every GPU)."""
    handle = ctypes.c_void_p()
    _check(_lib().cublasLtCreate(ctypes.byref(handle)), "create")
    return handle


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


class LtMatmul:
    """``y = x @ W^T`` for one problem: ``x (M, K)``, ``W (N, K)``, ``y (M, N)``, all row-major of one dtype (bf16 or
    fp16), fp32 accumulation."""

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype} is not one of {list(_DTYPES)}")
        lib = _lib()
        if lib is None:
            raise RuntimeError("cuBLASLt is not available (no CUDA device, or torch's libcublasLt was not found)")
        self.lib, self.shape, self.dtype = lib, (m, n, k), dtype
        vp = ctypes.c_void_p
        self.handle, self.desc = _handle(), vp()
        self.a, self.b, self.c = vp(), vp(), vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "desc")
        for attr, op in ((_DESC_TRANSA, 1), (_DESC_TRANSB, 0)):
            v = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), _SIZE4), "desc attribute")
        dt = _DTYPES[dtype]
        for layout, (rows, cols, ld) in ((self.a, (k, n, k)), (self.b, (k, m, k)), (self.c, (n, m, n))):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dt, ctypes.c_uint64(rows),
                                                  ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def __del__(self) -> None:
        lib = getattr(self, "lib", None)
        for name, destroy in (("a", "MatrixLayout"), ("b", "MatrixLayout"), ("c", "MatrixLayout"),
                              ("desc", "MatmulDesc")):
            obj = getattr(self, name, None)
            if lib is not None and obj is not None and obj.value:
                getattr(lib, f"cublasLt{destroy}Destroy")(obj)

    def heuristics(self, count: int = 64, max_workspace: int = 32 << 20) -> list[Algo]:
        """Up to ``count`` algorithms cuBLASLt's heuristic proposes, in its order (the first is torch's)."""
        lib, pref = self.lib, ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        try:
            ws = ctypes.c_uint64(max_workspace)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws), _SIZE8),
                   "pref")
            results, got = (_Heuristic * count)(), ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.c, self.c, pref,
                                                      count, results, ctypes.byref(got)), "heuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [self._algo(r.algo, r.workspace) for r in results[:got.value] if r.state == 0]

    def variants(self, algo: Algo, splits: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 16),
                 schemes: tuple[int, ...] = REDUCTIONS, max_workspace: int = 32 << 20) -> list[Algo]:
        """``algo`` with each split-K count and reduction scheme (:data:`REDUCTIONS`) cuBLASLt accepts here."""
        out = []
        for s in splits:
            for scheme in (0,) if s == 1 else schemes:
                st = algo.struct()
                for name, value in (("splitk", s), ("reduction", scheme)):
                    v = ctypes.c_uint32(value)
                    if self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(st), _CFG[name], ctypes.byref(v),
                                                                     _SIZE4) != 0:
                        break
                else:
                    res = _Heuristic()
                    if self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, self.a, self.b, self.c, self.c,
                                                        ctypes.byref(st), ctypes.byref(res)) == 0 \
                            and res.workspace <= max_workspace:
                        out.append(self._algo(st, res.workspace))
        return out

    def _algo(self, st: _AlgoStruct, workspace: int) -> Algo:
        config = []
        for name, attr in _CFG.items():
            v, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(st), attr, ctypes.byref(v), _SIZE4,
                                                             ctypes.byref(written)) == 0:
                config.append((name, v.value))
        return Algo(tuple(st.data), int(workspace), tuple(config))

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, algo: Algo,
                 workspace: torch.Tensor) -> torch.Tensor:
        """``out = x @ w.T`` with ``algo`` on ``x``'s device's current stream (capturable); ``workspace``: a CUDA byte
        buffer of at least ``algo.workspace`` bytes."""
        st = algo.struct()
        _check(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self._alpha), ctypes.c_void_p(w.data_ptr()), self.a,
            ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self._beta), ctypes.c_void_p(out.data_ptr()), self.c,
            ctypes.c_void_p(out.data_ptr()), self.c, ctypes.byref(st), ctypes.c_void_p(workspace.data_ptr()),
            ctypes.c_size_t(algo.workspace), ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)),
            "matmul")
        return out
