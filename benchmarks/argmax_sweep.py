"""The greedy argmax over a vocabulary: ``torch.argmax`` against :func:`llmplug.ops.argmax.argmax` at several block
sizes, GPU time per call in a CUDA graph over rotating logits (larger than L2 together), each checked equal first.

Usage: python benchmarks/argmax_sweep.py OUT.json [--vocab 128256] [--rows 1 8 64 128 256]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.bench import timing  # noqa: E402
from llmplug.ops import argmax as amod  # noqa: E402

BLOCKS = (1024, 2048, 4096, 8192, 16384)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 128, 256])
    args = ap.parse_args()
    read = timing.ceilings("cuda")["read_bytes_per_s"]
    rule, rows_out = amod.argmax_block, []
    for rows in args.rows:
        nbytes = rows * args.vocab * 2
        logits = [torch.randn(rows, args.vocab, device="cuda").bfloat16() for _ in range(max(2, (200 << 20) // nbytes))]
        want = logits[0].argmax(-1)
        row = {"rows": rows, "bytes": nbytes, "rule_block": rule(args.vocab),
               "torch_us": timing.graph_time(lambda x: x.argmax(-1), logits) * 1e6}
        for block in BLOCKS:
            amod.argmax_block = lambda v, _b=block: _b
            try:
                assert torch.equal(amod.argmax(logits[0]), want)
                row[f"block {block} us"] = timing.graph_time(amod.argmax, logits) * 1e6
            finally:
                amod.argmax_block = rule
        rows_out.append(row)
        best = min((k for k in row if k.startswith("block")), key=row.get)
        print(f"rows {rows}: torch {row['torch_us']:.1f} us ({100 * nbytes / row['torch_us'] / 1e-6 / read:.0f}% of "
              f"the read rate), {best} {row[best]:.1f} us ({100 * nbytes / row[best] / 1e-6 / read:.0f}%), rule "
              f"{row['rule_block']}: " + ", ".join(f"{k.split()[1]} {v:.1f}" for k, v in row.items()
                                                   if k.startswith("block")), flush=True)
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
