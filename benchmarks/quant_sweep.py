"""Quantized linear kernels vs bf16 cuBLAS on the Llama-3-8B projections, over token counts 1..8192.

For every (shape, token count, method) it times each candidate config of llmplug's kernels and cuBLAS bf16, as
CUDA-graph replays over 4 rotating weight copies (no launch overhead, no L2 reuse), checks each result against the
fp32 reference (SQNR), and prints GB/s (weight bytes + activations) and TFLOP/s. The best config per token count
and the crossovers between kernels feed ``choose_config`` in the ops.

    python benchmarks/quant_sweep.py results.json [--shapes 8b.qkv 8b.down] [--tokens 1 16 64]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.bench.timing import graph_time  # noqa: E402
from llmplug.ops.act_mul import act_and_mul  # noqa: E402
from llmplug.ops.fp8_linear import fp8_linear, fp8_linear_ref  # noqa: E402
from llmplug.ops.gemv import gemv  # noqa: E402
from llmplug.ops.w4_linear import w4_dequantize, w4_linear, w4_linear_ref  # noqa: E402
from llmplug.ops.w8_linear import w8_dequantize, w8_linear, w8_linear_ref  # noqa: E402
from llmplug.quant.formats import quantize_fp8, quantize_int4, quantize_int8, sqnr_db  # noqa: E402

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
          "8b.down+silu": (4096, 14336), "8b.lm_head": (128256, 4096)}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
# (BLOCK_M, BLOCK_N, BLOCK_K or GROUPS_PER_STEP, num_warps, num_stages, SPLIT_K); SPLIT_K 0 = the heuristic
GEMV = [(1, 2, 1024, 4, 4, 1), (1, 4, 512, 4, 4, 1), (1, 8, 512, 4, 4, 1), (1, 16, 256, 4, 4, 1),
        (1, 8, 1024, 8, 3, 1), (1, 4, 1024, 4, 3, 1), (1, 2, 2048, 4, 3, 1), (1, 16, 512, 4, 2, 1),
        (1, 16, 512, 4, 3, 1), (1, 32, 512, 8, 2, 1), (1, 16, 1024, 8, 2, 1), (1, 8, 256, 2, 3, 1),
        (1, 32, 256, 4, 2, 1)]
GEMV4 = [(1, 16, 4, 4, 1, 1), (1, 16, 8, 8, 1, 1), (1, 8, 4, 4, 1, 1), (1, 8, 8, 8, 1, 1), (1, 32, 2, 8, 1, 1),
         (1, 16, 2, 4, 1, 1), (1, 8, 8, 4, 1, 1), (1, 16, 8, 4, 1, 1), (1, 8, 16, 8, 1, 1), (1, 32, 8, 8, 1, 1),
         (1, 4, 8, 4, 1, 1), (1, 4, 16, 8, 1, 1), (1, 32, 4, 4, 1, 1)]
SKINNY = [(16, 32, 256, 4, 4, 0), (16, 64, 128, 4, 4, 0), (16, 32, 256, 4, 4, 1), (16, 64, 256, 4, 3, 0),
          (32, 64, 128, 4, 4, 0)]
SKINNY4 = [(16, 32, 1, 4, 4, 0), (16, 64, 1, 4, 4, 0), (16, 32, 1, 4, 4, 1), (16, 128, 1, 4, 3, 0),
           (32, 64, 1, 4, 4, 0)]
# one token only: deeper pipelines and explicit split-K for the padded tensor-core GEMM
SKINNY4_ONE = [(16, 64, 1, 4, 6, 0), (16, 64, 1, 4, 8, 0), (16, 32, 1, 4, 6, 0), (16, 32, 1, 2, 6, 0),
               (16, 64, 1, 4, 4, 2), (16, 32, 1, 4, 4, 4), (16, 128, 1, 8, 4, 0), (16, 64, 1, 8, 6, 0)]
GEMM = [(64, 64, 128, 4, 4, 0), (64, 128, 64, 4, 4, 0), (64, 128, 128, 4, 3, 0), (128, 128, 64, 8, 3, 0),
        (128, 256, 64, 8, 3, 0), (128, 128, 128, 8, 3, 0)]
GEMM4 = [(64, 64, 1, 4, 4, 0), (64, 128, 1, 4, 4, 0), (64, 128, 1, 4, 3, 0), (128, 128, 1, 8, 3, 0),
         (128, 256, 1, 8, 3, 0), (128, 64, 1, 4, 4, 0)]


def candidates(method: str, m: int):
    if method == "int4":
        if m == 1:  # the tensor-core GEMM (token padded to 16) competes with the GEMV on wide and deep shapes
            return GEMV4 + SKINNY4 + SKINNY4_ONE
        return SKINNY4 if m <= 32 else GEMM4
    if m == 1:
        return GEMV
    return SKINNY if m <= 32 else GEMM


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    ap.add_argument("--methods", nargs="*", default=["int8", "fp8_wo", "int4"], choices=["int8", "fp8_wo", "int4"])
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "rows": []}
    m_fp8 = max(args.tokens) >= 16  # the fp8 _scaled_mm row
    for name in args.shapes:
        n, k = SHAPES[name]
        act = "silu" if name.endswith("+silu") else ""
        dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(4)]
        quant = {
            "int8": [quantize_int8(w) for w in dense] if "int8" in args.methods else None,
            "int4": [quantize_int4(w, 128) for w in dense] if "int4" in args.methods else None,
            "fp8": [quantize_fp8(w) for w in dense] if "fp8_wo" in args.methods or m_fp8 else None,
        }
        wbytes = {"bf16": n * k * 2, "int8": n * k + 4 * n, "fp8": n * k + 4 * n, "int4": n * k // 2 + n * k // 32}
        for m in args.tokens if not act else [1]:
            x = torch.randn(m, 2 * k if act else k, dtype=torch.bfloat16, device="cuda")
            xin = act_and_mul(x, act) if act else x
            flops = 2 * m * n * k
            row = {"shape": name, "n": n, "k": k, "m": m}
            t = graph_time(lambda w, x=x, act=act: F.linear(act_and_mul(x, act) if act else x, w), dense)
            row["bf16_cublas"] = {"us": t * 1e6, "gbs": (wbytes["bf16"] + 2 * m * (k + n)) / t / 1e9,
                                  "tflops": flops / t / 1e12}
            if m == 1:
                t = graph_time(lambda w, x=x, act=act: gemv(act_and_mul(x, act) if act else x, w), dense)
                row["bf16_gemv"] = {"us": t * 1e6, "gbs": (wbytes["bf16"] + 2 * m * (k + n)) / t / 1e9,
                                    "tflops": flops / t / 1e12}
            runs = {
                "int8": (lambda w, cfg, x=x, act=act: w8_linear(act_and_mul(x, act) if act else x, *w, config=cfg),
                         lambda w, xin=xin: w8_linear_ref(xin, *w)),
                "fp8_wo": (lambda w, cfg, x=x, act=act: w8_linear(act_and_mul(x, act) if act else x, *w, config=cfg),
                           lambda w, xin=xin: w8_linear_ref(xin, *w)),
                "int4": (lambda w, cfg, x=x, act=act: w4_linear(act_and_mul(x, act) if act else x, *w, 128,
                                                                config=cfg),
                         lambda w, xin=xin: w4_linear_ref(xin, *w, 128)),
            }
            for method, (fn, ref) in runs.items():
                if method not in args.methods:
                    continue
                copies = quant["fp8" if method == "fp8_wo" else method]
                want = ref(copies[0]).float()
                best = None
                for cfg in candidates("int4" if method == "int4" else "w8", m):
                    try:
                        got = fn(copies[0], cfg).float()
                        q = sqnr_db(want, got)
                        t = graph_time(lambda w, cfg=cfg, fn=fn: fn(w, cfg), copies)
                    except Exception as e:  # a config that does not compile (shared memory) is skipped
                        print(f"  {name} m={m} {method} {cfg}: {type(e).__name__}", flush=True)
                        continue
                    entry = {"cfg": cfg, "us": t * 1e6, "sqnr_vs_ref": q,
                             "gbs": (wbytes["int4" if method == "int4" else "int8"] + 2 * m * (k + n)) / t / 1e9,
                             "tflops": flops / t / 1e12}
                    row.setdefault(method + "_all", []).append(entry)
                    if best is None or t * 1e6 < best["us"]:
                        best = entry
                row[method] = best
            if m >= 64 and quant["int4"] is not None:  # the prefill alternative: dequantise, then cuBLAS
                t = graph_time(lambda w, x=x: F.linear(x, w4_dequantize(*w, 128, x.dtype)), quant["int4"])
                row["int4_dense"] = {"us": t * 1e6, "gbs": (wbytes["int4"] + 2 * m * (k + n)) / t / 1e9,
                                     "tflops": flops / t / 1e12}
            if m >= 64 and quant["int8"] is not None:
                t = graph_time(lambda w, x=x: F.linear(x, w8_dequantize(*w, x.dtype)), quant["int8"])
                row["int8_dense"] = {"us": t * 1e6, "gbs": (wbytes["int8"] + 2 * m * (k + n)) / t / 1e9,
                                     "tflops": flops / t / 1e12}
            if m >= 16:
                t = graph_time(lambda w, x=x: fp8_linear(x, *w), quant["fp8"])
                q = sqnr_db(fp8_linear_ref(x, *quant["fp8"][0]).float(), fp8_linear(x, *quant["fp8"][0]).float())
                row["fp8_mm"] = {"us": t * 1e6, "gbs": (wbytes["fp8"] + 3 * m * k + 2 * m * n) / t / 1e9,
                                 "tflops": flops / t / 1e12, "sqnr_vs_ref": q}
            res["rows"].append(row)
            cells = " | ".join(f"{key} {row[key]['us']:7.1f}us {row[key]['gbs']:5.0f}GB/s {row[key]['tflops']:5.0f}TF"
                               + (f" {row[key]['cfg']}" if "cfg" in row[key] else "")
                               for key in ("bf16_cublas", "bf16_gemv", "int8", "int8_dense", "fp8_wo", "int4",
                                           "int4_dense", "fp8_mm")
                               if row.get(key))
            print(f"{name:11s} m={m:5d} | {cells}", flush=True)
        del dense, quant
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
