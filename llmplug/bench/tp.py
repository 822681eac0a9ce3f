"""Tensor parallelism's benchmark (``llmplug bench [--model M] tp --tp N``), one ``torchrun`` job that the command
launches itself.

Rank 0 alone runs the shape first (TP=1), then every rank runs it split (TP = world size); greedy ``generate`` of
128-token prompts, median of ``repeats`` timed calls after a warm-up, the weights made decisive
(:func:`llmplug.bench.spec.decisive`) so that both runs must give the same tokens. On CUDA the split runs once with
every all-reduce on NCCL and once with small ones through symmetric memory (``LLMPLUG_TP_ALLREDUCE=one_shot``), and
the all-reduce's latency inside a CUDA graph is measured both ways. ``split_build`` builds a shape too big for one GPU
split from the start (random values, no TP=1 run, the fraction of each rank's read roofline instead). ``agreement``:
greedy agreement of a trained model at TP=N with TP=1.
"""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import transformers

import llmplug

from ..parallel.group import TPGroup
from ..parallel.load import build_split
from ..state import state_of
from .e2e import row_agreement
from .shapes import SHAPES, build, weight_bytes
from .spec import decisive, held_out_files, timed
from .timing import ceilings

# NVLink multicast can put a shared host's GPUs out of service: off for every job this launches
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``llmplug <argv>`` under ``torchrun`` on ``nproc`` processes of this host (multicast off)."""
    env = {**os.environ, **SAFE_ENV}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "llmplug.cli", *argv]
    return subprocess.run(cmd, env=env).returncode


def join_group(cuda: bool, timeout_s: float = 300.0) -> int:
    """Under torchrun: this process's GPU (``LOCAL_RANK``) and the process group (NCCL on CUDA, gloo on CPU) -> its
    rank; the progress bars of ranks other than 0 are silenced."""
    rank = int(os.environ["RANK"])
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    if rank:
        os.environ["TQDM_DISABLE"] = "1"
    return rank


def allreduce_us(reduce, numel: int, reps: int = 64, dtype: torch.dtype = torch.bfloat16) -> float:
    """Microseconds of one ``reduce(x)`` of ``numel`` values, ``reps`` of them captured in one CUDA graph."""
    x = torch.ones(numel, dtype=dtype, device="cuda")
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


def one_shot_programs(group: TPGroup) -> dict:
    """The one-shot all-reduce's time at batch 8 and 32 (bf16, and fp32 shares at 32) by its program cap: {bytes:
    {programs: us}}; empty where symmetric memory is unavailable. The cap is restored afterwards."""
    one_shot = group.one_shot
    if one_shot is None:
        return {}
    out, default = {}, one_shot.programs
    try:
        for numel, dtype in ((32768, torch.bfloat16), (131072, torch.bfloat16), (131072, torch.float32)):
            key = numel * dtype.itemsize
            out[key] = {}
            for cap in (16, 32, 64, 128, 256):
                if cap <= one_shot.max_programs:
                    one_shot.programs = cap
                    out[key][cap] = allreduce_us(group.all_reduce, numel, dtype=dtype)
    finally:
        one_shot.programs = default
    return out


def decode(model, batch: int, new_tokens: int, repeats: int, device: str) -> tuple[float, torch.Tensor]:
    """Output tok/s of greedy ``generate`` over ``batch`` random 128-token prompts, and its tokens."""
    ids = torch.randint(3, model.config.vocab_size, (batch, 128), generator=torch.Generator().manual_seed(batch))
    ids = ids.to(device)
    gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    secs, out = timed(functools.partial(model.generate, **gen), repeats, device)
    return batch * new_tokens / secs, out.cpu()


def agreement(path: str, rank: int, world: int, prompts: int, new_tokens: int = 32, device: str = "cuda",
              dtype: torch.dtype = torch.bfloat16, stride: int = 256) -> dict | None:
    """Greedy agreement of the trained model at TP = world with TP=1 (rank 0 alone): the fraction of held-out
    prompts (64-token windows every ``stride`` tokens of the held-out stdlib files) whose ``new_tokens`` continuations
    are identical, generated all in one batch (cuBLAS projections) and one prompt at a time (the one-row GEMVs, CUDA
    graphs), with its Wilson 95% interval. Where a continuation differs, TP=1's margin between its two best logits
    at the first differing token says how near a tie the split decided. None on ranks other than 0."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    rows = []
    for f in held_out_files():
        ids = tokenizer(f.read_text(errors="ignore"))["input_ids"]
        rows += [ids[i:i + 64] for i in range(0, len(ids) - 64 + 1, stride)]
        if len(rows) >= prompts:
            break
    ids = torch.tensor(rows[:prompts], device=device)

    def continuations(model, margins: bool) -> dict:
        """way -> (new tokens (P, new_tokens), with ``margins`` the top-2 logit margins (P, new_tokens), else None)."""
        gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                   output_logits=margins)

        def run(rows_):
            out = model.generate(input_ids=rows_, attention_mask=torch.ones_like(rows_), **gen)
            gaps = None if out.logits is None else torch.stack(
                [torch.topk(step.float(), 2).values.diff(dim=-1).neg()[:, 0] for step in out.logits], dim=1).cpu()
            return out.sequences[:, -new_tokens:].cpu(), gaps

        singles = [run(row[None]) for row in ids]
        return {"batched": run(ids), "one_at_a_time": (torch.cat([t for t, _ in singles]),
                                                       torch.cat([g for _, g in singles]) if margins else None)}

    one = None
    if rank == 0:
        model = llmplug.optimize(build(path, dtype, device))
        one = continuations(model, margins=True)
        llmplug.unoptimize(model)
        del model
    dist.barrier()
    model = llmplug.optimize(build(path, dtype, device), tensor_parallel="auto")
    split = continuations(model, margins=False)  # every rank runs the same steps
    llmplug.unoptimize(model)
    if rank != 0:
        return None
    result = {"prompts": len(ids), "new_tokens": new_tokens}
    for way, (tokens, _) in split.items():
        want, gaps = one[way]
        found = row_agreement(tokens, want)
        hits = round(found["rows_identical"] * len(ids))
        result[way] = found["rows_identical"]
        result[f"{way}_interval"] = wilson_interval(hits, len(ids))
        result[f"{way}_margins_at_divergence"] = [round(float(gaps[i, p]), 4)
                                                  for i, p in enumerate(found["first_divergence"]) if p < new_tokens]
        print(f"greedy agreement of TP={world} with TP=1 on {path}, {way.replace('_', ' ')}: {hits} of "
              f"{len(ids)} prompts identical over {new_tokens} tokens (95% {result[f'{way}_interval']}); TP=1's "
              f"top-2 logit margins where they part: {result[f'{way}_margins_at_divergence']}", flush=True)
    return result


def wilson_interval(hits: int, n: int, z: float = 1.96) -> list[float]:
    """Wilson score interval of a fraction ``hits / n`` (95% at the default ``z``), rounded to 3 places."""
    p, z2 = hits / n, z * z
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), z * ((p * (1 - p) + z2 / (4 * n)) / n) ** 0.5 / (1 + z2 / n)
    return [round(centre - half, 3), round(centre + half, 3)]


def run(model_name: str, batches=(1, 8), new_tokens: int = 256, repeats: int = 3, allreduce=("nccl", "one_shot"),
        agreement_model: str | None = None, prompts: int = 64, split_build: bool = False) -> dict | None:
    """The benchmark on this rank (under ``torchrun``; initialises the process group) -> the report on rank 0."""
    cuda = torch.cuda.is_available()
    rank, world = join_group(cuda), int(os.environ["WORLD_SIZE"])
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    report = {"model": model_name, "world": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "ceilings": ceilings(device), "allreduce_us_in_graph": {}, "rows": []}
    if cuda:
        group = TPGroup(rank, world)
        os.environ["LLMPLUG_TP_ALLREDUCE"] = "one_shot"
        group.prepare(torch.device(device))
        for numel in (4096, 32768, 131072):  # 8 KB: one batch-1 8B hidden state; 64 KB: batch 8; 256 KB: batch 32
            report["allreduce_us_in_graph"][2 * numel] = {"nccl": allreduce_us(dist.all_reduce, numel),
                                                          "one_shot": allreduce_us(group.all_reduce, numel)}
        report["one_shot_us_by_programs"] = one_shot_programs(group)
    else:
        allreduce = ("nccl",)  # gloo: one way only
    reference = {}
    if rank == 0 and not split_build:
        torch.manual_seed(0)
        model = llmplug.optimize(decisive(build(model_name, dtype, device)))
        for b in batches:
            tok_s, reference[b] = decode(model, b, new_tokens, repeats, device)
            report["rows"].append({"tp": 1, "batch": b, "tok_s": tok_s})
        llmplug.unoptimize(model)
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    for mode in allreduce:  # the same weights split, every all-reduce on NCCL or small ones one-shot
        os.environ["LLMPLUG_TP_ALLREDUCE"] = mode
        torch.manual_seed(0)
        if split_build:
            model = build_split(SHAPES[model_name](), dtype, device)
            model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
        else:
            model = llmplug.optimize(decisive(build(model_name, dtype, device)), tensor_parallel="auto")
        rank_bytes = weight_bytes(model)
        for b in batches:
            tok_s, out = decode(model, b, new_tokens, repeats, device)
            row = {"tp": world, "allreduce": mode if cuda else "gloo", "batch": b, "tok_s": tok_s,
                   "rank_weight_bytes": rank_bytes}
            if b in reference:
                one = next(r for r in report["rows"] if r["tp"] == 1 and r["batch"] == b)
                row.update(speedup=tok_s / one["tok_s"], identical=torch.equal(out, reference[b]))
            if b == 1 and report["ceilings"]:
                row["fraction_of_rank_roofline"] = tok_s * rank_bytes / report["ceilings"]["read_bytes_per_s"]
            report["rows"].append(row)
        if split_build:  # too big to gather back: drop its pool and graphs (they hold NCCL work) before the group
            state_of(model).runner.release()
        else:
            llmplug.unoptimize(model)
        del model
        gc.collect()
    if agreement_model:
        report["agreement"] = agreement(agreement_model, rank, world, prompts, device=device, dtype=dtype)
    dist.barrier()
    dist.destroy_process_group()
    return report if rank == 0 else None


def table(report: dict) -> list[str]:
    lines = [f"all-reduce in a CUDA graph, us by bytes: {report['allreduce_us_in_graph']}"] \
        if report["allreduce_us_in_graph"] else []
    if report.get("one_shot_us_by_programs"):
        lines.append(f"one-shot all-reduce, us by bytes and program cap: {report['one_shot_us_by_programs']}")
    lines += ["| tp | all-reduce | batch | tok/s | speed-up | identical | of the rank's read roofline |",
              "| ---: | --- | ---: | ---: | ---: | --- | ---: |"]
    for r in report["rows"]:
        same = "" if "identical" not in r else ("yes" if r["identical"] else "NO")
        roof = f"{r['fraction_of_rank_roofline']:.1%}" if "fraction_of_rank_roofline" in r else ""
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        lines.append(f"| {r['tp']} | {r.get('allreduce', '')} | {r['batch']} | {r['tok_s']:,.1f} | {speedup} | "
                     f"{same} | {roof} |")
    return lines
