"""The one-shot kernels are GPU-only (an inline-PTX barrier the interpreter cannot run): on the CPU they are at least
compiled for Hopper, so a change that breaks their compilation fails here and not first on a GPU machine. In a child
process: the test session runs Triton's interpreter, under which ``triton.jit`` makes nothing to compile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmplug.parallel import one_shot

out = {}
for name, signature, constants in json.loads(sys.argv[1]):
    src = ASTSource(fn=getattr(one_shot, name), signature={**signature, **dict.fromkeys(constants, "constexpr")},
                    constexprs=constants)
    out[name] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
print(json.dumps(out))
"""

CASES = [
    ("_one_shot_kernel",
     {"x_ptr": "*bf16", "out_ptr": "*bf16", "bufs": "*i64", "pads": "*i64", "slot_offset": "i32", "numel": "i32"},
     {"rank": 0, "world": 2, "BLOCK": 1024, "PDL": True}),
    ("_one_shot_add_norm_kernel",
     {"x_ptr": "*fp32", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "total_ptr": "*bf16", "bufs": "*i64",
      "pads": "*i64", "slot_offset": "i32", "M": "i32", "N": "i32", "eps": "fp32", "offset": "fp32", "scale": "fp32"},
     {"rank": 1, "world": 4, "BLOCK": 4096, "SCALED": True, "ROUND_FIRST": True}),
]


def test_one_shot_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(CASES)], capture_output=True, text=True, env=env,
                         timeout=300)
    if run.returncode and ("ptxas" in run.stderr or "No module named 'triton.backends" in run.stderr):
        pytest.skip(f"this Triton cannot compile for a CUDA target here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr
    ptx = json.loads(run.stdout.strip().splitlines()[-1])
    for name, _, constants in CASES:
        code = ptx[name]
        assert "atom.global.release.sys.cas.b32" in code and "atom.global.acquire.sys.cas.b32" in code, name  # barrier
        assert code.count("ld.global") >= constants["world"], name  # every rank's slot is read
