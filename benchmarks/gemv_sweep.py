"""Batch-1 GEMV: llmplug's gemv configs vs cuBLAS (F.linear) on every decode projection of llama-1b/8b.

Timed as CUDA-graph replays over 4 rotating weight copies (no launch overhead, no L2 reuse). Prints GB/s.

    python benchmarks/gemv_sweep.py out.json           # configs vs cuBLAS
    python benchmarks/gemv_sweep.py out.json --norm    # add_rms_norm + gemv vs add_norm_gemv (norm in the prologue)
    python benchmarks/gemv_sweep.py out.json --tp      # one rank's projections: 8B at TP=2, 70B at TP=4
"""

import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.bench.timing import graph_time  # noqa: E402
from llmplug.ops._triton import programmatic_launch  # noqa: E402
from llmplug.ops.gemv import add_norm_gemv, choose_config, gemv  # noqa: E402
from llmplug.ops.rms_norm import add_rms_norm  # noqa: E402

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
          "8b.lm_head": (128256, 4096), "1b.qkv": (3072, 2048), "1b.o": (2048, 2048), "1b.gate_up": (16384, 2048),
          "1b.down": (2048, 8192), "1b.lm_head": (128256, 2048)}
# one rank's share under tensor parallelism (q/k/v, gate/up and the vocabulary split by rows, o and down by columns)
TP_SHAPES = {"8b/2.qkv": (3072, 4096), "8b/2.o": (4096, 2048), "8b/2.gate_up": (14336, 4096),
             "8b/2.down": (4096, 7168), "8b/2.lm_head": (64128, 4096), "70b/4.qkv": (2560, 8192),
             "70b/4.o": (8192, 2048), "70b/4.gate_up": (14336, 8192), "70b/4.down": (8192, 7168),
             "70b/4.lm_head": (32064, 8192)}
CONFIGS = [(32, 512, 8, 3), (64, 256, 8, 3),
           (8, 512, 4, 4), (4, 1024, 4, 4), (16, 256, 4, 4), (8, 1024, 8, 3), (16, 512, 8, 3), (4, 512, 2, 4),
           (2, 1024, 4, 4), (32, 256, 8, 3), (8, 256, 4, 6)]


@torch.inference_mode()
def main(out_path: str, shapes: dict) -> None:
    res = {}
    for name, (n, k) in shapes.items():
        copies = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        nbytes = n * k * 2
        row = {"cublas": nbytes / graph_time(lambda w, x=x: F.linear(x, w), copies) / 1e9}
        ref = F.linear(x.float(), copies[0].float())
        for cfg in CONFIGS:
            got = gemv(x, copies[0], config=cfg).float()
            err = ((got - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (name, cfg, err)
            row[str(cfg)] = nbytes / graph_time(lambda w, x=x, cfg=cfg: gemv(x, w, config=cfg), copies) / 1e9
        res[name] = row
        best = max((v, c) for c, v in row.items())
        print(f"{name:13s} cublas {row['cublas']:5.0f} GB/s | chosen {choose_config(n, k)} | best {best[1]} "
              f"{best[0]:5.0f} GB/s | "
              + " ".join(f"{row[str(c)]:5.0f}" for c in CONFIGS), flush=True)
        del copies
    Path(out_path).write_text(json.dumps(res, indent=1))


def _separate(x, r, nw, gated, config, w):
    normed, _ = add_rms_norm(x, r, nw, 1e-5)
    return gemv(normed, w, config=config, gated=gated)


def _fused(x, r, nw, gated, config, w):
    return add_norm_gemv(x, r, nw, 1e-5, 0.0, w, config=config, gated=gated)[0]


@torch.inference_mode()
def norm_sweep(out_path: str) -> None:
    """Per projection that follows a norm (q/k/v, gate/up, lm_head): the norm kernel then the GEMV against the GEMV
    with the norm in its prologue (default config, and twice the rows a program), us a call, under programmatic
    dependent launch as in a decode step."""
    res = {}
    for name, (n, k) in SHAPES.items():
        if name.endswith((".o", ".down")):
            continue
        copies = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(4)]
        x, r = (torch.randn(1, k, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        nw = torch.rand(k, dtype=torch.bfloat16, device="cuda")
        gated = "silu" if name.endswith("gate_up") else ""
        cfg = choose_config(n, k)
        wide = (2 * cfg[0], *cfg[1:])
        with programmatic_launch():
            row = {f"separate {cfg}": graph_time(functools.partial(_separate, x, r, nw, gated, cfg), copies),
                   f"fused {cfg}": graph_time(functools.partial(_fused, x, r, nw, gated, cfg), copies),
                   f"fused {wide}": graph_time(functools.partial(_fused, x, r, nw, gated, wide), copies)}
        res[name] = {key: t * 1e6 for key, t in row.items()}
        print(f"{name:12s} " + " | ".join(f"{key} {t:7.2f} us" for key, t in res[name].items()), flush=True)
        del copies
    Path(out_path).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    if "--norm" in sys.argv[2:]:
        norm_sweep(sys.argv[1])
    else:
        main(sys.argv[1], TP_SHAPES if "--tp" in sys.argv[2:] else SHAPES)
