"""GEMMs of a serving step's CUDA graphs through the cuBLASLt algorithm that timed fastest at warm-up.

At 9-256 rows ``F.linear`` runs the first algorithm cuBLAS's heuristic names, which is often not the fastest of the
candidates cuBLASLt offers (a 1B model's down projection at 128 rows: 16.3 us against 14.3 for a split-K variant on
an H200; BENCHMARKS.md, "cuBLASLt's other algorithms"). Before a runner captures the graphs of a row count its
forward asks :func:`tune` for its weights grouped by shape, keeps each choice on the linear it is for (a choice is made
only where it beats torch's own by :data:`MARGIN`) and runs it through :func:`matmul`.

Candidates are cuBLASLt's heuristic list and split-K variants of its first few, each checked against ``F.linear``
and against itself on a second run (bit for bit; split-K sums in a fixed order) before it is timed in a CUDA graph
over the group's weights (rotated, so L2 does not hold them). Which algorithm wins can differ between processes
(timings), and with it the last bits of bf16 results: the runner tunes only under
``OptimizeConfig(gemm_tuning=True)``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..bench.timing import graph_time
from . import _cublaslt
from .skinny_gemv import MAX_ROWS as SKINNY_ROWS

__all__ = ["MARGIN", "MAX_ROWS", "MIN_ROWS", "choices", "matmul", "tune"]

MIN_ROWS, MAX_ROWS = SKINNY_ROWS + 1, 256  # fewer rows: llmplug's GEMVs; more: prefill-sized, cuBLAS's choice holds
MARGIN = 0.97  # a candidate replaces F.linear only when it takes at most this share of F.linear's time
_HEURISTICS, _SPLIT_HEURISTICS, _SPLITS = 8, 4, (2, 3, 4, 6, 8)
_WORKSPACE = 16 << 20  # bytes of the one workspace every chosen algorithm of a device shares (one stream at a time)
_DTYPES = (torch.bfloat16, torch.float16)
_TIMED_BYTES = 128 << 20  # weights a timing graph rotates over, at least (more than L2 holds)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The algorithm chosen for one (rows, N, K, dtype) and the times that chose it (us a call)."""

    plan: _cublaslt.LtMatmul
    algo: _cublaslt.Algo
    us: float
    linear_us: float


_measured: dict[tuple, Choice | None] = {}  # what timing found, by (device index, dtype, rows, N, K): any model's
_workspaces: dict[int, torch.Tensor] = {}


def choices() -> dict[tuple, Choice | None]:
    """Every choice :func:`tune` has timed in this process: ``(device index, dtype, rows, N, K) -> Choice`` (None:
    ``F.linear`` stays)."""
    return dict(_measured)


def matmul(choice: Choice, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x (M, K) @ weight (N, K)^T`` through ``choice`` (of :func:`tune` for this ``M, N, K``), or None where ``x`` is
    not a row-major ``(M, K)`` of the weight's dtype, or under ``torch.compile``: the caller then runs ``F.linear``."""
    m, k = x.shape
    n = weight.shape[0]
    if (choice.plan.shape != (m, n, k) or x.stride() != (k, 1) or not weight.is_contiguous()
            or x.dtype != choice.plan.dtype or weight.dtype != x.dtype or torch.compiler.is_compiling()):
        return None
    out = x.new_empty((m, n))
    return choice.plan(x, weight, out, choice.algo, _workspaces[x.device.index])


def tune(groups: dict[tuple[int, int], list[torch.Tensor]], rows: int) -> dict[tuple[int, int], Choice]:
    """For ``rows`` rows, the algorithm to run for each group of weights ``(N, K) -> [W (N, K), ...]`` (one dtype and
    device, contiguous) where one beats ``F.linear``: ``(N, K) -> Choice``, timed on first asking (a process's later
    calls for the same rows and shape reuse the result). Empty outside ``MIN_ROWS..MAX_ROWS``, off CUDA, for other
    dtypes and where cuBLASLt is not found. Call it outside CUDA-graph capture (it times candidates in graphs of its
    own)."""
    out: dict[tuple[int, int], Choice] = {}
    if not MIN_ROWS <= rows <= MAX_ROWS:
        return out
    for (n, k), weights in groups.items():
        w = weights[0]
        if not w.is_cuda or w.dtype not in _DTYPES or not _cublaslt.available():
            continue
        key = (w.device.index, w.dtype, rows, n, k)
        if key not in _measured:
            if w.device.index not in _workspaces:
                _workspaces[w.device.index] = torch.empty(_WORKSPACE, dtype=torch.uint8, device=w.device)
            timed, size = [], 0
            for t in weights:  # enough of the group to read past L2
                if size >= _TIMED_BYTES:
                    break
                timed.append(t)
                size += t.numel() * t.element_size()
            with torch.cuda.device(w.device):
                _measured[key] = _choose(rows, timed, _workspaces[w.device.index])
        if _measured[key] is not None:
            out[(n, k)] = _measured[key]
    return out


def _us(fn, weights: list[torch.Tensor]) -> float:
    """us a call of ``fn(w)`` over ``weights``, in a CUDA graph of two passes (:func:`graph_time`)."""
    return graph_time(fn, weights, reps=2, replays=3) * 1e6


def _choose(m: int, weights: list[torch.Tensor], workspace: torch.Tensor) -> Choice | None:
    n, k = weights[0].shape
    dtype = weights[0].dtype
    x = torch.randn(m, k, dtype=dtype, device=weights[0].device)
    out = torch.empty(m, n, dtype=dtype, device=x.device)
    want = F.linear(x, weights[0]).float()
    plan = _cublaslt.LtMatmul(m, n, k, dtype)
    heuristics = plan.heuristics(_HEURISTICS, _WORKSPACE)
    candidates, seen = [], set()
    for i, algo in enumerate(heuristics):
        for a in [algo] + (plan.variants(algo, _SPLITS, (1,), _WORKSPACE) if i < _SPLIT_HEURISTICS else []):
            if a.data not in seen:
                seen.add(a.data)
                candidates.append(a)
    best, best_us = None, float("inf")
    for algo in candidates:
        try:
            first = plan(x, weights[0], out, algo, workspace).clone()
            if not torch.equal(first, plan(x, weights[0], out, algo, workspace)):
                continue
            if not torch.allclose(first.float(), want, rtol=2e-2, atol=2e-2):
                continue
            us = _us(lambda w, a=algo: plan(x, w, out, a, workspace), weights)
        except RuntimeError:  # an algorithm this problem's pointers or sizes do not suit after all
            continue
        if us < best_us:
            best, best_us = algo, us
    linear_us = _us(lambda w: F.linear(x, w), weights)
    return Choice(plan, best, best_us, linear_us) if best is not None and best_us <= MARGIN * linear_us else None
