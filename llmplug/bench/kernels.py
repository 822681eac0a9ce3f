"""Attention kernel microbenchmarks beside torch SDPA and the measured ceilings (CUDA only)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ..ops.decode_attention import decode_attention
from ..ops.kv_quant import quantize_ref
from ..ops.prefill_attention import prefill_attention

H, HKV, D, P = 32, 8, 128, 16


def _bench(fn, calls: int = 10, replays: int = 10) -> float:
    """Seconds per call of ``fn`` on the GPU alone: ``calls`` calls captured in one CUDA graph, replayed, median."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / calls)
    return sorted(times)[len(times) // 2]


def prefill(seq_lens=(1024, 4096, 8192), tokens: int = 16384, dtype=torch.bfloat16) -> dict:
    """Causal GQA prefill TFLOP/s, llmplug vs SDPA, ``tokens // S`` sequences of length S."""
    out = {}
    for s in seq_lens:
        b = max(1, tokens // s)
        q = torch.randn(b * s, H, D, dtype=dtype, device="cuda")
        k = torch.randn(b * s, HKV, D, dtype=dtype, device="cuda")
        v = torch.randn_like(k)
        cache = torch.empty(1, P, HKV, D, dtype=dtype, device="cuda")
        bt = torch.zeros(b, 1, dtype=torch.int32, device="cuda")
        cu = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * s
        ctx = torch.zeros(b, dtype=torch.int32, device="cuda")
        scale = D**-0.5
        ours = _bench(partial(prefill_attention, q, k, v, cache, cache, bt, cu, ctx, s, scale))
        qs, ks, vs = (x.view(b, s, -1, D).transpose(1, 2) for x in (q, k, v))
        sdpa = _bench(partial(F.scaled_dot_product_attention, qs, ks, vs, is_causal=True, enable_gqa=True))
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(1, 2)
        got = prefill_attention(q, k, v, cache, cache, bt, cu, ctx, s, scale).view(b, s, H, D)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        flops = 4 * b * H * D * s * s / 2
        out[s] = {"batch": b, "llmplug_s": ours, "sdpa_s": sdpa, "llmplug_tflops": flops / ours / 1e12,
                  "sdpa_tflops": flops / sdpa / 1e12, "ratio_vs_sdpa": sdpa / ours, "rel_err_vs_sdpa": err}
    return out


def decode(batches=(1, 8, 64), contexts=(1024, 8192, 32768), dtype=torch.bfloat16, read_bw: float = 0.0,
           kv_cache_dtype: torch.dtype | None = None) -> dict:
    """Paged decode attention GB/s over the K/V bytes it must read (scales included for an fp8/int8
    ``kv_cache_dtype``), and the fraction of read bandwidth."""
    out = {}
    for b in batches:
        for ctx in contexts:
            blocks = b * ctx // P
            k_cache = torch.randn(blocks, P, HKV, D, dtype=dtype, device="cuda")
            v_cache = torch.randn_like(k_cache)
            scales = {}
            if kv_cache_dtype is not None:
                (k_cache, k_scale), (v_cache, v_scale) = (quantize_ref(c, kv_cache_dtype) for c in (k_cache, v_cache))
                scales = {name: s.transpose(1, 2).contiguous() for name, s in (("k_scale", k_scale),
                                                                                ("v_scale", v_scale))}
            bt = torch.randperm(blocks, device="cuda").to(torch.int32).view(b, ctx // P)
            seq = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(b, H, D, dtype=dtype, device="cuda")
            t = _bench(partial(decode_attention, q, k_cache, v_cache, bt, seq, D**-0.5, **scales))
            nbytes = 2 * b * ctx * HKV * (D * k_cache.element_size() + (4 if scales else 0))
            row = {"s": t, "gb_per_s": nbytes / t / 1e9}
            if read_bw:
                row["fraction_of_read_bw"] = nbytes / t / read_bw
            out[f"b{b}_ctx{ctx}"] = row
    return out
