"""The paged decode-attention kernels of a tree, compiled for sm_90 on any machine (no GPU needed), as each PTX's
instruction multiset: an A/B by construction for a change that must leave the runtime's kernels as they were.

    python benchmarks/decode_kernel_ptx.py TREE > a.json   # e.g. a `git archive` of the old tree, then "."

Configurations: the runtime's bf16, D = 128, GQA 4, pages of 16: plain decode with 4 splits, the fused RoPE + store
with the last split combining, one split; and the split-combine kernel. Run it with ``TRITON_INTERPRET`` unset.
"""

import collections
import json
import re
import sys

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from llmplug.ops import decode_attention  # noqa: E402

POINTERS = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "k_scale_ptr": "*bf16",
            "v_scale_ptr": "*bf16", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
            "part_ptr": "*fp32", "lse_ptr": "*fp32", "kn_ptr": "*bf16", "vn_ptr": "*bf16", "cos_ptr": "*fp32",
            "sin_ptr": "*fp32", "slot_ptr": "*i32", "counters_ptr": "*i32", "key_mask_ptr": "*i32"}
FLOATS = ("score_scale", "cap_scale")
ATTENTION = dict(GROUP=4, PAGE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16, BLOCK_N=64, SOFTCAP=False, QUANT=False,
                 QMAX_=0.0, IS_INT=False, BLOCK_S=4, DOT_PRECISION="tf32", INTERPRETED=False, PDL=True, DENSE=False,
                 KEY_MASK=False)
COMBINE = dict(NUM_SPLITS=4, HEAD_DIM=128, BLOCK_N=64, BLOCK_S=4, BLOCK_D=128, NEW_TOKEN=False, INTERPRETED=False,
               DENSE_LEN=0, PDL=True)


def instructions(fn, constants: dict, num_warps: int) -> dict:
    """``fn`` compiled for sm_90 with ``constants`` (those it has), every other argument typed by its name."""
    signature = {}
    for p in fn.params:
        if not p.is_constexpr:
            signature[p.name] = POINTERS.get(p.name, "fp32" if p.name in FLOATS else "i32")
        elif p.name in constants:
            signature[p.name] = "constexpr"
    src = ASTSource(fn=fn, signature=signature, constexprs={k: v for k, v in constants.items() if k in signature})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    return dict(collections.Counter(m.group(1) for m in re.finditer(r"^\s+([a-z][\w.]*)", body, re.M)))


def main() -> None:
    out = {}
    for name, extra in (("plain", dict(NEW_TOKEN=False, NUM_SPLITS=4, LAST_COMBINES=False)),
                        ("rope", dict(NEW_TOKEN=True, NUM_SPLITS=4, LAST_COMBINES=True)),
                        ("one_split", dict(NEW_TOKEN=False, NUM_SPLITS=1, LAST_COMBINES=False))):
        out[name] = instructions(decode_attention._decode_attn_kernel, {**ATTENTION, **extra}, 4)
    out["combine"] = instructions(decode_attention._decode_attn_combine_kernel, COMBINE, 2)
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
