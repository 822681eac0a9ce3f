"""Where an engine step's time goes on the GPU: scheduling, input packing, forward, sampling sync, bookkeeping.

Usage: python benchmarks/profile_engine.py --model llama-8b --requests 128 --prompt 32 --out-tokens 256
"""

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
from llmplug.bench import shapes  # noqa: E402


def timed(store, name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            store[name] += time.perf_counter() - t
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=int, nargs=2, default=[32, 32])
    ap.add_argument("--out-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--fraction", type=float, default=0.85)
    ap.add_argument("--no-prefix", action="store_true")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens of a system prompt every request starts with")
    args = ap.parse_args()
    model = shapes.build(args.model, torch.bfloat16, "cuda")
    llmplug.optimize(model, kv_memory_fraction=args.fraction)
    config = llmplug.EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget,
                                  enable_prefix_caching=not args.no_prefix)
    eng = llmplug.Engine(model, config)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    system = torch.randint(0, vocab, (args.shared_prefix,), generator=g).tolist()

    def prompts(n):
        lens = torch.randint(args.prompt[0], args.prompt[1] + 1, (n,), generator=g).tolist()
        return [system + torch.randint(0, vocab, (n_,), generator=g).tolist() for n_ in lens]

    params = llmplug.SamplingParams(max_new_tokens=args.out_tokens, do_sample=False, ignore_eos=True)
    t = time.perf_counter()
    eng.warmup()
    eng.generate(prompts(min(8, args.requests)), params, progress=False)  # warm-up: compiles, graphs
    eng.generate(prompts(args.requests), llmplug.SamplingParams(max_new_tokens=4, ignore_eos=True), progress=False)
    torch.cuda.synchronize()
    print(f"warm-up {time.perf_counter() - t:.1f} s", flush=True)
    eng.metrics.reset()
    eng.blocks.reset_cache()  # the timed run starts with an empty prefix cache
    spent = defaultdict(float)
    sched = eng.scheduler
    sched.schedule = timed(spent, "schedule", sched.schedule)
    eng._launch = timed(spent, "launch (inputs, forward, sample)", eng._launch)
    eng._resolve = timed(spent, "resolve (wait for tokens, stop checks)", eng._resolve)
    ps = prompts(args.requests)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = eng.generate(ps, params, progress=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    stats = eng.stats()
    res = {"args": vars(args), "wall_s": wall, "output_tok_s": n_out / wall, "steps": stats["steps"],
           "per_step_ms": {k: 1e3 * v / max(stats["steps"], 1) for k, v in spent.items()}, "stats": stats}
    print(json.dumps(res, indent=1, default=str))
    out = os.environ.get("OUT")
    if out:
        Path(out, f"profile_engine_{args.requests}x{args.shared_prefix}+{args.prompt[1]}x{args.out_tokens}"
                                f"{'_noprefix' if args.no_prefix else ''}.json").write_text(
            json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
