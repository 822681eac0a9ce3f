"""Where a batch-1 decode step's time goes: graph replay alone vs the whole generate step, and a per-kernel
breakdown of one eager decode step (torch.profiler).

    python benchmarks/profile_decode.py llama-8b [--batch 1] [--quantize int4]
"""

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug.bench.shapes import build, weight_bytes  # noqa: E402
from llmplug.bench.timing import replay_seconds  # noqa: E402
from llmplug.engine.runner import decode_metadata  # noqa: E402


@torch.inference_mode()
def main(name: str, batch: int = 1, quantize: str | None = None, profile_host: bool = False) -> None:
    model = build(name, torch.bfloat16, "cuda")
    llmplug.optimize(model, quantize=quantize)
    ids = torch.randint(3, 1000, (batch, 128), device="cuda")
    model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    runner = model._llmplug_runner
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(input_ids=ids, max_new_tokens=256, do_sample=False)
    torch.cuda.synchronize()
    step = (time.perf_counter() - t0) / 256
    sample = dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9)
    model.generate(input_ids=ids, max_new_tokens=8, **sample)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(input_ids=ids, max_new_tokens=256, eos_token_id=None, **sample)
    torch.cuda.synchronize()
    sampled = (time.perf_counter() - t0) / 256
    t0 = time.perf_counter()
    for _ in range(10):
        model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) / 10
    bucket = runner.graph_bucket(batch)  # plain greedy generate replays the greedy graph (decode + token choice)
    graph, buf = runner._graphs.get(("greedy", bucket)) or runner._graphs[("decode", bucket)]
    buf["positions"][:batch] = 200
    replay = replay_seconds(graph)
    wb = weight_bytes(model)
    print(f"{name} {quantize or 'bf16'} b{batch}: generate step {step * 1e3:.3f} ms, "
          f"graph replay {replay * 1e3:.3f} ms, weights {wb / 1e9:.2f} GB -> {wb / replay / 1e12:.2f} TB/s in replay")
    glue = (256 * step - first - 255 * replay) / 255
    print(f"generate with one new token (set-up + prefill) {first * 1e3:.2f} ms; per decode step outside the graph "
          f"{glue * 1e6:.0f} us; sampled generate step (temperature 0.7, top-k 50, top-p 0.9) {sampled * 1e3:.3f} ms")
    if profile_host:
        import cProfile
        import pstats

        with cProfile.Profile() as host:
            model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
            torch.cuda.synchronize()
        pstats.Stats(host).sort_stats("cumulative").print_stats(30)
    pos = torch.full((batch,), 200, device="cuda")
    bt = buf["block_tables"][:batch]
    _, meta = decode_metadata(pos, bt, runner.block_size)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.forward(buf["input_ids"][:batch], pos, meta, None)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:70]][0] += 1
            per[e.name[:70]][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total = sum(v[1] for v in per.values())
    print(f"eager step kernels: {sum(v[0] for v in per.values())} launches, {total / 1e3:.3f} ms of kernel time")
    for k, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:24]:
        print(f"  {us / 1e3:8.3f} ms {n:5d}x  {k}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("shape")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quantize", choices=("int8", "int4", "fp8"))
    ap.add_argument("--profile-host", action="store_true", help="cProfile one generate call of one new token")
    args = ap.parse_args()
    main(args.shape, args.batch, args.quantize, args.profile_host)
