"""Tensor-parallel decode against one GPU, in one ``torchrun`` job (issue 24).

Rank 0 alone runs the shape first (TP=1), then every rank runs it split (TP = world size); greedy ``generate`` of
128-token prompts, median of ``--repeats`` timed calls after a warm-up, the weights made decisive
(:func:`llmplug.bench.spec.decisive`) so that both runs must give the same tokens; the split runs once with every
all-reduce on NCCL and once with small ones through symmetric memory (``LLMPLUG_TP_ALLREDUCE=one_shot``). Also the
all-reduce's latency inside a CUDA graph, both ways.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --standalone --nproc-per-node 2 benchmarks/tp_bench.py --model llama-8b --out tp.json
"""

import argparse
import functools
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug.bench.shapes import build, weight_bytes  # noqa: E402
from llmplug.bench.spec import decisive, held_out_files, timed  # noqa: E402
from llmplug.parallel.group import TPGroup  # noqa: E402


def allreduce_us(reduce, numel: int, reps: int = 64) -> float:
    """Microseconds of one ``reduce(x)`` of ``numel`` bf16 values, ``reps`` of them captured in one CUDA graph."""
    x = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / 10 / reps


def decode(model, batch: int, new_tokens: int, repeats: int) -> tuple[float, torch.Tensor]:
    """Output tok/s of greedy ``generate`` over ``batch`` random 128-token prompts, and its tokens."""
    ids = torch.randint(3, model.config.vocab_size, (batch, 128), generator=torch.Generator().manual_seed(batch))
    ids = ids.cuda()
    gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    secs, out = timed(functools.partial(model.generate, **gen), repeats, "cuda")
    return batch * new_tokens / secs, out.cpu()


def agreement(path: str, rank: int, world: int, prompts: int, new_tokens: int = 32, device: str = "cuda",
              dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Greedy agreement of the trained model at TP = world with TP=1 (rank 0 alone) in bf16: the fraction of
    held-out prompts (each the first 64 tokens of a held-out stdlib file) whose ``new_tokens`` continuations are
    identical. None on ranks other than 0."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    rows = []
    for f in held_out_files():
        ids = tokenizer(f.read_text(errors="ignore"))["input_ids"]
        if len(ids) >= 64:
            rows.append(ids[:64])
        if len(rows) == prompts:
            break
    ids = torch.tensor(rows, device=device)
    gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
               min_new_tokens=new_tokens)
    one = None
    if rank == 0:
        model = llmplug.optimize(build(path, dtype, device))
        one = model.generate(**gen).cpu()
        llmplug.unoptimize(model)
        del model
    dist.barrier()
    model = llmplug.optimize(build(path, dtype, device), tensor_parallel="auto")
    split = model.generate(**gen).cpu()
    llmplug.unoptimize(model)
    if rank != 0:
        return None
    same = (split == one).all(dim=1)
    print(f"greedy agreement of TP={world} with TP=1 on {path}: {int(same.sum())} of {len(rows)} prompts identical "
          f"over {new_tokens} tokens", flush=True)
    return float(same.float().mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--allreduce", nargs="+", choices=["nccl", "one_shot"], default=["nccl", "one_shot"],
                    help="TP runs: every all-reduce on NCCL, and/or small ones through symmetric memory")
    ap.add_argument("--agreement", metavar="DIR", help="also: greedy agreement with TP=1 of this trained model, bf16")
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts of the agreement check")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    report = {"model": args.model, "world": world, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "allreduce_us_in_graph": {}, "rows": []}
    group = TPGroup(rank, world)
    os.environ["LLMPLUG_TP_ALLREDUCE"] = "one_shot"
    group.prepare(torch.device("cuda"), torch.bfloat16)
    for numel in (4096, 32768, 131072):  # 8 KB: one batch-1 8B hidden state; 64 KB: batch 8; 256 KB: batch 32
        report["allreduce_us_in_graph"][2 * numel] = {"nccl": allreduce_us(dist.all_reduce, numel),
                                                      "one_shot": allreduce_us(group.all_reduce, numel)}
    reference = {}
    if rank == 0:
        torch.manual_seed(0)
        model = llmplug.optimize(decisive(build(args.model, torch.bfloat16, "cuda")))
        for b in args.batches:
            tok_s, reference[b] = decode(model, b, args.new_tokens, args.repeats)
            report["rows"].append({"tp": 1, "batch": b, "tok_s": tok_s, "weight_bytes": weight_bytes(model)})
        llmplug.unoptimize(model)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    dist.barrier()
    torch.manual_seed(0)
    model = decisive(build(args.model, torch.bfloat16, "cuda"))
    for mode in args.allreduce:  # the same weights split, with every all-reduce on NCCL or small ones one-shot
        os.environ["LLMPLUG_TP_ALLREDUCE"] = mode
        llmplug.optimize(model, tensor_parallel="auto")
        for b in args.batches:
            tok_s, out = decode(model, b, args.new_tokens, args.repeats)
            if rank == 0:
                one = next(r for r in report["rows"] if r["tp"] == 1 and r["batch"] == b)
                report["rows"].append({"tp": world, "allreduce": mode, "batch": b, "tok_s": tok_s,
                                       "speedup": tok_s / one["tok_s"], "identical": torch.equal(out, reference[b])})
        llmplug.unoptimize(model)  # its graphs hold NCCL work: gone before the process group
    if args.agreement:
        report["agreement"] = agreement(args.agreement, rank, world, args.prompts)
    if rank == 0:
        print(f"all-reduce in a CUDA graph, us by bytes: {report['allreduce_us_in_graph']}")
        print("| tp | all-reduce | batch | tok/s | speed-up | identical |")
        print("| ---: | --- | ---: | ---: | ---: | --- |")
        for r in report["rows"]:
            print(f"| {r['tp']} | {r.get('allreduce', '')} | {r['batch']} | {r['tok_s']:,.1f} | "
                  f"{r.get('speedup', 1.0):.2f}x | {'' if r['tp'] == 1 else ('yes' if r['identical'] else 'NO')} |",
                  flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
