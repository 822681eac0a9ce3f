"""Do cuBLAS's kernels wait on the grid dependency? (GPU only.) The answer decides whether a captured decode step may
launch them programmatically, as its Triton kernels are, closing the ~1 us gap at every kernel boundary next to one
(BENCHMARKS.md, "Fourth session of 2026-12-02").

For each GEMM shape, a graph of two kernels is captured: a Triton kernel that lets its dependents launch at once
(``griddepcontrol.launch_dependents``), then spins ~``--spin`` iterations before writing ones into ``x``; then the
consumer, reading ``x``. The edge between them is made programmatic (driver API, edge data) and the graph replayed:
a consumer that waits (``griddepcontrol.wait``) sees the ones, one that does not reads ``x`` while it is still zeros.
Controls: a Triton consumer that waits (``rms_norm`` under programmatic launch) must pass, one compiled without the
wait must fail (else the probe could not tell). Then, for each shape, the replay time of 16 (spin-free) norm + GEMM
pairs with default and with programmatic edges into the GEMMs.

    python benchmarks/pdl_edge_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from llmplug.bench.timing import replay_seconds
from llmplug.engine.graph_edges import GraphApi, copy_no_wait, race
from llmplug.ops._triton import programmatic_launch, triton
from llmplug.ops.rms_norm import rms_norm


def report_race(api: GraphApi, consumer, x: torch.Tensor, spins: int) -> dict:
    key, waited = race(api, consumer, x, spins)
    return {"kernel": None if key is None else key[0], "grid": None if key is None else key[1], "waited": waited}


def chain_time(api: GraphApi, x: torch.Tensor, weights: list, norm_w: torch.Tensor, programmatic: bool) -> float:
    """us a layer of ``--layers`` norm + GEMM pairs in one graph (norm under programmatic launch), GEMM edges default or
    programmatic."""
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        with programmatic_launch():
            for w in weights:
                F.linear(rms_norm(x, norm_w, 1e-5), w)
    if programmatic:
        raw = g.raw_cuda_graph()
        kernels = api.kernel_nodes(raw)
        api.make_programmatic(raw, kernels, lambda a, b: "rms_norm" not in kernels[b][0])
    g.instantiate()
    return replay_seconds(g, replays=20, warmup=3) * 1e6 / len(weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--spin", type=int, default=20000)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    api = GraphApi()
    dt, m = torch.bfloat16, args.rows
    shapes = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    x64 = torch.zeros(m, 2048, device="cuda", dtype=dt)
    norm_w = torch.rand(2048, device="cuda", dtype=dt) + 0.5
    y = torch.empty_like(x64)

    def no_wait(x):
        copy_no_wait[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y

    report["control_waits"] = report_race(api, lambda x: rms_norm(x, norm_w, 1e-5), x64, args.spin)
    report["control_no_wait"] = report_race(api, no_wait, x64, args.spin)
    print("controls", report["control_waits"], report["control_no_wait"], flush=True)
    for name, (n, k) in shapes.items():
        x = torch.zeros(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
        report[name] = report_race(api, lambda t, w=w: F.linear(t, w), x, args.spin)
        print(name, report[name], flush=True)
    for name, (n, k) in shapes.items():
        if k != 2048:
            continue
        x = torch.randn(m, k, device="cuda", dtype=dt)
        ws = [torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5 for _ in range(args.layers)]
        t0, t1 = chain_time(api, x, ws, norm_w, False), chain_time(api, x, ws, norm_w, True)
        report[f"chain_{name}_us"] = {"default": t0, "programmatic": t1}
        print(f"norm + {name}: {t0:.2f} us a pair default, {t1:.2f} programmatic", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
