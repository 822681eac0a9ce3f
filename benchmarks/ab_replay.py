"""A/B of one decode-step change in one process: greedy decode graph replay time with the change on, off, on again.

    python benchmarks/ab_replay.py decode_slots|rope_table|norm_gemv llama-1b [llama-8b ...]

``decode_slots``: the one-kernel ``decode_slots`` against its PyTorch reference (a dozen small kernels);
``rope_table``: RoPE cos/sin gathered from the once-filled table against HF's rotary module each step;
``norm_gemv``: residual add + RMSNorm in the next GEMV's prologue against the separate norm kernel. Each variant
recaptures the graphs, generates 64 greedy tokens (compared across variants) and reports the min of 5 x 200 replays.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmplug  # noqa: E402
import llmplug.engine.runner as runner_module  # noqa: E402
import llmplug.patches.decoder as decoder_module  # noqa: E402
from llmplug.bench.shapes import build  # noqa: E402
from llmplug.bench.timing import replay_seconds  # noqa: E402
from llmplug.ops.decode_slots import decode_slots, decode_slots_ref  # noqa: E402
from llmplug.ops.gemv import add_norm_gemv, gemv  # noqa: E402
from llmplug.ops.rms_norm import add_rms_norm  # noqa: E402
from llmplug.state import state_of  # noqa: E402


def separate_norm_gemv(x, residual, norm_weight, eps, offset, weight, bias=None, config=None, gated=""):
    """``add_norm_gemv`` as two kernels: the norm, then the GEMV."""
    normed, residual = add_rms_norm(x, residual, norm_weight, eps, offset)
    return gemv(normed, weight, bias, config, gated), residual


def replay_ms(graph, buf) -> float:
    times = []
    for _ in range(5):
        with torch.inference_mode():
            buf["positions"][:1] = 200
        times.append(replay_seconds(graph, replays=200, warmup=10) * 1e3)
    return min(times)


def set_variant(change: str, runner, on: bool) -> None:
    if change == "decode_slots":
        runner_module.decode_slots = decode_slots if on else decode_slots_ref
    elif change == "norm_gemv":
        decoder_module.add_norm_gemv = add_norm_gemv if on else separate_norm_gemv
    else:
        runner.rope_by_position, runner.forward_fn._rope_tables = on, None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("change", choices=("decode_slots", "rope_table", "norm_gemv"))
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    for name in args.models:
        model = build(name, torch.bfloat16, "cuda")
        llmplug.optimize(model)
        runner = state_of(model).runner
        ids = torch.randint(3, 1000, (1, 128), device="cuda")
        times, tokens = {}, {}
        for label, on in (("on", True), ("off", False), ("on again", True)):
            set_variant(args.change, runner, on)
            runner.release()  # graphs (and KV pool) recaptured with the variant
            tokens[label] = model.generate(input_ids=ids, max_new_tokens=64, do_sample=False)
            times[label] = replay_ms(*runner._graphs[("greedy", 1)])
        same = all(torch.equal(t, tokens["on"]) for t in tokens.values())
        print(f"{name} {args.change}: replay ms " + ", ".join(f"{k} {v:.4f}" for k, v in times.items())
              + f"; same tokens: {same}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
