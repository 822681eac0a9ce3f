"""GPU kernels of a tensor-parallel decode step by name, on rank 0 (issue 24): where a TP=N step's time goes.

Run under torchrun, one process a GPU, multicast off; ``LLMPLUG_TP_ALLREDUCE`` picks the all-reduce:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 LLMPLUG_TP_ALLREDUCE=one_shot \\
        torchrun --standalone --nproc-per-node 2 benchmarks/tp_profile.py --model llama-8b --out prof.json
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

import llmplug
from llmplug.bench.shapes import build
from llmplug.bench.spec import decisive
from llmplug.bench.timing import kernels_by_name
from llmplug.bench.tp import join_group


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="rows of the generate call (32: workload (b)'s batch)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rank = join_group(True)
    torch.manual_seed(0)
    model = llmplug.optimize(decisive(build(args.model, torch.bfloat16, "cuda")), tensor_parallel="auto")
    ids = torch.randint(3, model.config.vocab_size, (args.batch, 128),
                        generator=torch.Generator().manual_seed(1)).cuda()
    gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.steps)
    model.generate(**gen)
    model.generate(**gen)
    torch.cuda.synchronize()
    dist.barrier()
    totals = kernels_by_name(lambda: model.generate(**gen), per=args.steps)
    if rank == 0:
        mode = os.environ.get("LLMPLUG_TP_ALLREDUCE", "one_shot")
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "batch": args.batch, "allreduce": mode,
                       "device": torch.cuda.get_device_name(), "kernels_us_per_step": totals}, f, indent=1)
        print(f"{mode}: {sum(totals.values()):.0f} us of kernels a step (prefill amortized); the top 14:")
        for name, us in list(totals.items())[:14]:
            print(f"  {us:8.1f}  {name[:100]}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
