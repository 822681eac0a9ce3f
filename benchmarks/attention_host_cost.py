"""Host time per call of the eager attention's ops at 1B shapes, on a small mixed step the GPU keeps up with (so the
host is what is timed), beside a ``torch.add`` launch for scale.

Usage: python benchmarks/attention_host_cost.py   (CUDA; prints a table)
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.engine.attention import rope_paged_attention  # noqa: E402
from llmplug.engine.metadata import AttentionMetadata  # noqa: E402
from llmplug.ops._triton import programmatic_launch  # noqa: E402
from llmplug.ops.decode_attention import decode_attention  # noqa: E402
from llmplug.ops.prefill_attention import prefill_attention  # noqa: E402
from llmplug.ops.rope_store_kv import rope_store_kv  # noqa: E402


def main() -> None:
    dev, bf16 = "cuda", torch.bfloat16
    t, nd, h, hkv, d = 64, 8, 32, 8, 64  # 8 decode rows and one 56-token prompt chunk
    q = torch.randn(t, h, d, dtype=bf16, device=dev)
    k, v = torch.randn(t, hkv, d, dtype=bf16, device=dev), torch.randn(t, hkv, d, dtype=bf16, device=dev)
    cos, sin = torch.randn(t, d, dtype=bf16, device=dev), torch.randn(t, d, dtype=bf16, device=dev)
    kc = torch.zeros(4000, 16, hkv, d, dtype=bf16, device=dev)
    vc = torch.zeros_like(kc)
    tables = torch.arange((nd + 1) * 64, dtype=torch.int32, device=dev).view(nd + 1, 64)
    cu = torch.tensor(list(range(nd + 1)) + [t], dtype=torch.int32, device=dev)
    ctx = torch.full((nd + 1,), 500, dtype=torch.int32, device=dev)
    ctx[-1] = 0
    slots = torch.arange(t, device=dev)
    meta = AttentionMetadata(query_len=0, slot_mapping=slots, block_tables=tables, cu_seqlens_q=cu, context_lens=ctx,
                             max_seqlen_q=t - nd, num_decodes=nd, seq_lens=ctx[:nd] + 1)
    out = torch.empty_like(q)
    calls = {
        "rope_store_kv": lambda: rope_store_kv(q, k, v, cos, sin, kc, vc, slots),
        "decode_attention": lambda: decode_attention(q[:nd], kc, vc, tables[:nd], meta.seq_lens, 0.125, out=out[:nd]),
        "prefill_attention": lambda: prefill_attention(q, k, v, kc, vc, tables[nd:], cu[nd:], ctx[nd:], t - nd, 0.125,
                                                       out=out),
        "rope_paged_attention (a layer)": lambda: rope_paged_attention(q, k, v, cos, sin, kc, vc, meta, 0.125),
        "torch.add (a launch, for scale)": lambda: torch.add(q, q, out=out),
    }
    with programmatic_launch():
        for name, fn in calls.items():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            n, t0 = 300, time.perf_counter()
            for _ in range(n):
                fn()
            host = (time.perf_counter() - t0) / n
            torch.cuda.synchronize()
            total = (time.perf_counter() - t0) / n
            print(f"{name:32s} host {host * 1e6:7.1f} us/call   with the GPU {total * 1e6:7.1f} us/call", flush=True)


if __name__ == "__main__":
    main()
