"""Triton compiles during timed Engine runs: which kernels compile after the warm-up, and for how long.

Usage: TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/engine_compiles.py [MODEL [WORKLOADS]]   e.g. llama-1b a,c,b
(a fresh cache: a fresh machine's compiles). Every workload runs twice at scale 1 after the throughput benchmark's
warm-up; JSON to $OUT (or .).
"""

import collections
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
from triton import knobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug.bench import shapes, workloads  # noqa: E402
from llmplug.bench.throughput import _drop, run_offline, warm_up  # noqa: E402
from llmplug.bench.workloads import ModelCost  # noqa: E402

COMPILES: list[dict] = []


def _started(**kw):
    COMPILES.append({"kernel": kw["repr"].split("[")[0], "key": str(kw["key"]), "constants": str(kw["compile"].get(
        "constants")), "signature": str(kw["compile"].get("signature")), "t0": time.perf_counter()})
    return False  # compile as usual


def _finished(**kw):
    for c in reversed(COMPILES):
        if c["key"] == str(kw["key"]) and "seconds" not in c:
            c["seconds"] = time.perf_counter() - c["t0"]
            break


def main() -> None:
    knobs.runtime.jit_cache_hook = _started
    knobs.runtime.jit_post_compile_hook = _finished
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    keys = sys.argv[2].split(",") if len(sys.argv) > 2 else ["a", "c", "b"]
    torch.manual_seed(0)
    model = shapes.build(name, torch.bfloat16, "cuda")
    cost = ModelCost.of(model)
    llmplug.optimize(model)
    vocab = model.config.vocab_size
    wls = {k: workloads.build(k, vocab, 1.0) for k in keys}
    config = llmplug.EngineConfig()
    t = time.perf_counter()
    warm_up(model, config, list(wls.values()), vocab)
    res = {"model": name, "warmup_s": time.perf_counter() - t, "warmup_compiles": len(COMPILES), "runs": {}}
    print(f"warm-up {res['warmup_s']:.1f} s, {len(COMPILES)} compiles", flush=True)
    for rep in (1, 2):
        for key, wl in wls.items():
            first = len(COMPILES)
            engine = llmplug.Engine(model, config)
            rec = run_offline(engine, wl, cost, {})
            _drop(engine)
            gc.collect()
            new = COMPILES[first:]
            seconds = sum(c.get("seconds", 0.0) for c in new)
            kernels = dict(collections.Counter(c["kernel"] for c in new))
            print(f"{key} run {rep}: wall {rec['wall_s']:.3f} s, {len(new)} compiles ({seconds:.2f} s): {kernels}",
                  flush=True)
            res["runs"][f"{key}{rep}"] = {"wall_s": rec["wall_s"], "compiles": new}
    Path(os.environ.get("OUT", "."), f"engine_compiles_{name}.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
