"""cuBLAS and cuBLASLt on the Llama-3.2-1B decode step's GEMMs at serving batches (M = 128, 256 rows): us per call in
a CUDA graph (weights rotated past L2) and the share of the measured read roofline, per matrix and for a whole step's
GEMMs (16 layers and the lm_head).

Usage: python benchmarks/gemm_probe.py   (CUDA)
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.bench import timing  # noqa: E402

bf = torch.bfloat16
dev = "cuda"
read = timing.ceilings(dev)["read_bytes_per_s"]
shapes = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "lm_head": (128256, 2048)}
for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    for m in (128, 256):
        row, tot_t, tot_b = [], 0.0, 0
        for name, (n, k) in shapes.items():
            copies = max(1, (256 << 20) // (n * k * 2))
            ws = [torch.randn(n, k, dtype=bf, device=dev) for _ in range(min(copies, 8))]
            x = torch.randn(m, k, dtype=bf, device=dev)
            t = timing.graph_time(lambda w, x=x: F.linear(x, w), ws)
            b = n * k * 2 + m * k * 2 + m * n * 2
            layers = 1 if name == "lm_head" else 16
            tot_t, tot_b = tot_t + t * layers, tot_b + b * layers
            row.append(f"{name} {t * 1e6:.1f}us {100 * b / t / read:.0f}%")
        step = f"| step GEMMs {tot_t * 1e3:.3f} ms {100 * tot_b / tot_t / read:.0f}%"
        print(lib, m, " | ".join(row), step, flush=True)
