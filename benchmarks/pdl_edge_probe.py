"""Do cuBLAS's kernels wait on the grid dependency? (GPU only.) The answer decides whether a captured decode step may
launch them programmatically, as its Triton kernels are, closing the ~1 us gap at every kernel boundary next to one
(BENCHMARKS.md, "Fourth session of 2026-12-02").

For each GEMM shape, a graph of two kernels is captured: a Triton kernel that lets its dependents launch at once
(``griddepcontrol.launch_dependents``), then spins ``--spins`` iterations before writing ones into ``x``; then the
consumer, reading ``x``. The edge between them is made programmatic (driver API, edge data) and the graph replayed
ten times: a consumer that waits (``griddepcontrol.wait``) sees the ones, one that does not reads ``x`` while it is
still zeros, unless its blocks could not become resident until the spinning ones retired: a short spin can pass a
kernel that does not wait (at 128 rows the q/k/v kernel passed 5k spins and failed 20k: BENCHMARKS.md, "Fifth session
of 2026-12-02"), so a kernel counts as waiting only if it passes every spin length.
Controls: a Triton consumer that waits (``rms_norm`` under programmatic launch) must pass, one compiled without the
wait must fail (else the probe could not tell). Then, for each shape, the replay time of 16 (spin-free) norm + GEMM
pairs with default and with programmatic edges into the GEMMs (a kernel that does not wait computes on stale
inputs there: a bound, not a result).

    python benchmarks/pdl_edge_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch
import torch.nn.functional as F
from triton.language.extra.cuda import gdc_launch_dependents

from llmplug.bench.timing import replay_seconds
from llmplug.ops._triton import programmatic_launch, tl, triton
from llmplug.ops.rms_norm import rms_norm

CU_GRAPH_NODE_TYPE_KERNEL = 0
CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 1
CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1


class EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ("cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphKernelNodeGetParams_v2", "cuFuncGetName",
                 "cuKernelGetName",
                 "cuGraphGetEdges_v2", "cuGraphRemoveDependencies_v2", "cuGraphAddDependencies_v2"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with CUresult {status}")


def kernel_nodes(lib, graph: int) -> dict[int, str]:
    """Kernel node handle -> its function's name."""
    count = ctypes.c_size_t(0)
    _check(lib.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(lib.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(count)), "cuGraphGetNodes")
    out = {}
    for node in nodes:
        kind = ctypes.c_int(-1)
        _check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value != CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        # CUDA_KERNEL_NODE_PARAMS_v2 as 8-byte words: func, grid/block dims and shared bytes, kernelParams, extra,
        # kern (a library kernel where func is null), ctx
        params = (ctypes.c_uint64 * 16)()
        _check(lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), params), "cuGraphKernelNodeGetParams_v2")
        name = ctypes.c_char_p()
        if params[0]:
            status = lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params[0]))
        else:
            status = lib.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params[7]))
        out[node] = name.value.decode() if status == 0 and name.value else f"? (CUresult {status})"
    return out


def edges(lib, graph: int) -> list[tuple[int, int, int]]:
    """``(from, to, dependency type)`` of every edge."""
    count = ctypes.c_size_t(0)
    _check(lib.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(count)), "cuGraphGetEdges")
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (EdgeData * n)()
    _check(lib.cuGraphGetEdges_v2(ctypes.c_void_p(graph), src, dst, data, ctypes.byref(count)), "cuGraphGetEdges")
    return [(src[i], dst[i], data[i].type) for i in range(n)]


def make_programmatic(lib, graph: int, into) -> int:
    """Turn every default edge between two kernel nodes whose target's name passes ``into`` programmatic; returns how
    many edges changed."""
    names = kernel_nodes(lib, graph)
    changed = 0
    for a, b, kind in edges(lib, graph):
        if kind != 0 or a not in names or b not in names or not into(names[b]):
            continue
        old = EdgeData()
        new = EdgeData(CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, 0, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
        src, dst = (ctypes.c_void_p * 1)(a), (ctypes.c_void_p * 1)(b)
        _check(lib.cuGraphRemoveDependencies_v2(ctypes.c_void_p(graph), src, dst, ctypes.byref(old), 1),
               "cuGraphRemoveDependencies_v2")
        _check(lib.cuGraphAddDependencies_v2(ctypes.c_void_p(graph), src, dst, ctypes.byref(new), 1),
               "cuGraphAddDependencies_v2")
        changed += 1
    return changed


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
def _copy_no_wait(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """The negative control: reads ``x`` without waiting on the grid dependency."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def race(lib, consumer, x: torch.Tensor, spins: int, into, replays: int = 10) -> dict:
    """Capture spin-then-fill + ``consumer(x)``, make the edge into ``into`` kernels programmatic, replay: in how many
    replays did the consumer see only the ones, and what fraction of its output was right on average?"""
    want = consumer(torch.ones_like(x)).clone()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    x.zero_()
    with torch.cuda.graph(g):
        _spin_then_fill[(triton.cdiv(x.numel(), 1024),)](x, x.numel(), spins, BLOCK=1024)
        with programmatic_launch():
            out = consumer(x)
    changed = make_programmatic(lib, g.raw_cuda_graph(), into)
    names = sorted(set(kernel_nodes(lib, g.raw_cuda_graph()).values()))
    g.instantiate()
    seen, right = 0, 0.0
    for _ in range(replays):
        x.zero_()
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        seen += bool(torch.equal(out, want))
        right += (out == want).float().mean().item() / replays
    return {"kernels": names, "edges_changed": changed, "spins": spins, "replays": replays, "saw_the_writes": seen,
            "right_fraction": right}


def races(lib, consumer, x: torch.Tensor, spins: list[int], into) -> dict:
    """:func:`race` at each spin length; ``waits``: every replay at every length saw the writes. A kernel that does
    not wait can still pass a short spin (its blocks become resident only as the spinning ones retire), so only a
    pass at every length counts."""
    runs = [race(lib, consumer, x, s, into) for s in spins]
    return {"runs": runs, "waits": all(r["saw_the_writes"] == r["replays"] for r in runs)}


def chain_time(lib, x: torch.Tensor, weights: list, norm_w: torch.Tensor, programmatic: bool) -> float:
    """us a layer of ``--layers`` norm + GEMM pairs in one graph (norm under programmatic launch), GEMM edges default or
    programmatic."""
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        with programmatic_launch():
            for w in weights:
                F.linear(rms_norm(x, norm_w, 1e-5), w)
    if programmatic:
        make_programmatic(lib, g.raw_cuda_graph(), lambda name: "rms_norm" not in name)
    g.instantiate()
    return replay_seconds(g, replays=20, warmup=3) * 1e6 / len(weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--spins", type=int, nargs="+", default=[5000, 20000, 80000])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    lib = _driver()
    dt, m = torch.bfloat16, args.rows
    shapes = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    x64 = torch.zeros(m, 2048, device="cuda", dtype=dt)
    norm_w = torch.rand(2048, device="cuda", dtype=dt) + 0.5
    y = torch.empty_like(x64)

    def no_wait(x):
        _copy_no_wait[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y

    report["control_waits"] = races(lib, lambda x: rms_norm(x, norm_w, 1e-5), x64, args.spins,
                                   lambda name: "rms_norm" in name)
    report["control_no_wait"] = races(lib, no_wait, x64, args.spins, lambda name: "copy_no_wait" in name)
    print("controls", report["control_waits"], report["control_no_wait"], flush=True)
    for name, (n, k) in shapes.items():
        x = torch.zeros(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
        report[name] = races(lib, lambda t, w=w: F.linear(t, w), x, args.spins, lambda nm: "spin_then_fill" not in nm)
        print(name, report[name], flush=True)
    for name, (n, k) in shapes.items():
        if k != 2048:
            continue
        x = torch.randn(m, k, device="cuda", dtype=dt)
        ws = [torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5 for _ in range(args.layers)]
        t0, t1 = chain_time(lib, x, ws, norm_w, False), chain_time(lib, x, ws, norm_w, True)
        report[f"chain_{name}_us"] = {"default": t0, "programmatic": t1}
        print(f"norm + {name}: {t0:.2f} us a pair default, {t1:.2f} programmatic", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
