"""Does prefetching a GEMM's weights into L2 from the small kernel before it speed a decode layer up? (GPU only.)

cuBLAS's kernels cannot be launched programmatically (``pdl_edge_probe.py``), so each one ramps up from a cold start
after its predecessor's end: at 128 rows the 1B model's GEMMs run at ~63% of their weights' read time (BENCHMARKS.md,
"Fourth session of 2026-12-02"). Here the Triton kernel before each GEMM (add + RMSNorm before q/k/v and gate/up, a
norm standing in for attention before o, SiLU-and-mul before down) first issues ``cp.async.bulk.prefetch.L2`` for the
head of every row of the GEMM's weight (the first ``f`` of its K, where each cuBLAS program starts reading), then
does its own work. Weights are fixed, so this is safe before the grid-dependency wait.

A graph of ``--layers`` such layers (distinct weights, no reuse between replays beyond L2) is timed per layer, with
prefetch fractions ``f`` for every GEMM, and with ``--isolate`` for one GEMM at a time.

    python benchmarks/l2_prefetch_probe.py --out prefetch.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmplug.bench.timing import replay_seconds
from llmplug.ops._triton import pdl_options, programmatic_launch, tl, triton

E, QKV, FFN = 2048, 3072, 8192


@triton.jit
def _prefetch_heads(w_ptr, n_rows, row_bytes, head_bytes, BLOCK: tl.constexpr):
    """This program's share of one bulk L2 prefetch of ``head_bytes`` at the start of each of ``n_rows`` rows."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    base = w_ptr.to(tl.pointer_type(tl.int8))
    for start in range(pid * BLOCK, n_rows, nprog * BLOCK):
        rows = tl.minimum(start + tl.arange(0, BLOCK), n_rows - 1)
        sizes = tl.zeros([BLOCK], dtype=tl.int32) + head_bytes
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [base + rows.to(tl.int64) * row_bytes, sizes], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _prefetch_then_wait(pf_ptr, pf_rows, pf_row_bytes, pf_head_bytes, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """The prefetch share (weights: before the wait), then the grid-dependency wait and trigger."""
    if PREFETCH:
        _prefetch_heads(pf_ptr, pf_rows, pf_row_bytes, pf_head_bytes, BLOCK=128)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _norm_kernel(x_ptr, x_stride, res_ptr, w_ptr, out_ptr, eps, pf_ptr, pf_rows, pf_row_bytes, pf_head_bytes,
                 E: tl.constexpr, ADD: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """Row ``pid``: ``res += x`` (with ``ADD``), ``out = rms_norm(res or x) * w``; first the prefetch share."""
    _prefetch_then_wait(pf_ptr, pf_rows, pf_row_bytes, pf_head_bytes, PREFETCH, PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E)
    x = tl.load(x_ptr + row * x_stride + offs).to(tl.float32)
    if ADD:
        x += tl.load(res_ptr + row * E + offs).to(tl.float32)
        tl.store(res_ptr + row * E + offs, x.to(res_ptr.dtype.element_ty))
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / E + eps) * tl.load(w_ptr + offs).to(tl.float32)
    tl.store(out_ptr + row * E + offs, y.to(out_ptr.dtype.element_ty))


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, pf_ptr, pf_rows, pf_row_bytes, pf_head_bytes, F_: tl.constexpr,
                     PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """Row ``pid``: ``out = silu(x[:, :F]) * x[:, F:]``; first the prefetch share."""
    _prefetch_then_wait(pf_ptr, pf_rows, pf_row_bytes, pf_head_bytes, PREFETCH, PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, F_)
    g = tl.load(x_ptr + row * 2 * F_ + offs).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * F_ + F_ + offs).to(tl.float32)
    tl.store(out_ptr + row * F_ + offs, (g / (1 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty))


def _pf_args(w: torch.Tensor, frac: float) -> tuple:
    head = int(w.shape[1] * frac) // 8 * 16  # bytes of bf16, a multiple of 16
    return w, w.shape[0], w.stride(0) * w.element_size(), max(head, 16)


def norm(x, res, w, out, nxt, frac):
    _norm_kernel[(x.shape[0],)](x, x.stride(0), res, w, out, 1e-5, *_pf_args(nxt, frac), E=E, ADD=res is not None,
                                PREFETCH=frac > 0, num_warps=4, **pdl_options(x))
    return out


def silu_mul(x, out, nxt, frac):
    _silu_mul_kernel[(x.shape[0],)](x, out, *_pf_args(nxt, frac), F_=FFN, PREFETCH=frac > 0, num_warps=8,
                                    **pdl_options(x))
    return out


def layer_chain(rows: int, layers: list[dict], fracs: dict[str, float]):
    """One step of ``layers`` (norm, q/k/v, norm, o, add + norm, gate/up, SiLU-mul, down) on fixed buffers."""
    dev, dt = "cuda", torch.bfloat16
    x, res = torch.randn(rows, E, device=dev, dtype=dt), torch.randn(rows, E, device=dev, dtype=dt)
    h, a = torch.empty(rows, E, device=dev, dtype=dt), torch.empty(rows, FFN, device=dev, dtype=dt)
    nw = torch.rand(E, device=dev, dtype=dt) + 0.5

    def step():
        y = x
        for lay in layers:
            qkv = F.linear(norm(y, res, nw, h, lay["qkv"], fracs["qkv"]), lay["qkv"])
            o = F.linear(norm(qkv, None, nw, h, lay["o"], fracs["o"]), lay["o"])
            gu = F.linear(norm(o, res, nw, h, lay["gate_up"], fracs["gate_up"]), lay["gate_up"])
            y = F.linear(silu_mul(gu, a, lay["down"], fracs["down"]), lay["down"])
        return y

    return step


def time_chain(rows: int, layers: list[dict], fracs: dict[str, float]) -> float:
    """us a layer of one replay of :func:`layer_chain`'s step (prefetching changes no value: timing only)."""
    step = layer_chain(rows, layers, fracs)
    with programmatic_launch():
        step()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
    return replay_seconds(g, replays=30, warmup=3) * 1e6 / len(layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--fracs", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0])
    ap.add_argument("--isolate", type=float, default=0.5)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    shapes = {"qkv": (QKV, E), "o": (E, E), "gate_up": (2 * FFN, E), "down": (E, FFN)}
    layers = [{k: torch.randn(n, kk, device=dev, dtype=dt) / kk ** 0.5 for k, (n, kk) in shapes.items()}
              for _ in range(args.layers)]
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "layers": args.layers, "runs": []}
    for rows in args.rows:
        variants = [("none", dict.fromkeys(shapes, 0.0))]
        variants += [(f"all {f:g}", dict.fromkeys(shapes, f)) for f in args.fracs]
        variants += [(f"{k} {args.isolate:g}", {j: args.isolate if j == k else 0.0 for j in shapes}) for k in shapes]
        for name, fracs in variants + variants[:1]:  # the baseline again last: drift
            us = time_chain(rows, layers, fracs)
            report["runs"].append({"rows": rows, "variant": name, "fracs": fracs, "us_per_layer": us})
            print(f"rows {rows:4d}  {name:12s} {us:7.2f} us a layer", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
