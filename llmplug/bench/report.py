"""Results as JSON (device, versions, commit, command) and a printed table beside the ceilings."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers


def git_commit() -> str | None:
    """``HEAD``'s hash, with ``+dirty`` when tracked files differ from it; None without a usable git history (the
    device tool's copy of the tree: record the commit by hand there)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent)

    try:
        head, status = git("rev-parse", "--verify", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except OSError:
        return None
    if head.returncode or status.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def environment() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
        "commit": git_commit(), "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def save(results: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str))
    return path


def _cell(value: float | None, width: int) -> str:
    """``value`` with one decimal right-aligned in ``width`` characters, or ``skipped`` where it was not measured."""
    return f"{value:{width}.1f}" if value is not None else f"{'skipped':>{width}s}"


def e2e_table(r: dict, ceil: dict) -> list[str]:
    """Lines of the end-to-end table for one model's results ``r``."""
    new = r["new_tokens"]
    bw = ceil.get("read_bytes_per_s")
    roof = bw / r["weight_bytes"] if bw else None
    lines = [f"## {Path(r['model']).name} ({r['dtype']}, weights {r['weight_bytes'] / 1e9:.2f} GB)"]
    if roof:
        lines.append(f"batch-1 roofline: {roof:.1f} tok/s (weights / measured read bandwidth {bw / 1e12:.2f} TB/s)")
    lines.append(f"{'what':42s} {'stock eager':>12s} {'stock static':>13s} {'llmplug':>10s} {'x best stock':>12s}"
                 f" {'% roofline':>10s}")
    b1 = {k: new / r[k]["median"] for k in ("stock_eager_b1", "stock_static_compile_b1", "llmplug_b1") if k in r}
    best = max(v for k, v in b1.items() if k != "llmplug_b1")
    frac = f"{100 * b1['llmplug_b1'] / roof:9.1f}%" if roof else f"{'-':>10s}"
    lines.append(f"{f'batch-1 decode tok/s (128 in, {new} out)':42s} {b1['stock_eager_b1']:12.1f} "
                 f"{_cell(b1.get('stock_static_compile_b1'), 13)} {b1['llmplug_b1']:10.1f} "
                 f"{b1['llmplug_b1'] / best:11.2f}x {frac}")
    for n in r.get("llmplug_ttft", {}):
        s, o = r["stock_ttft"][n]["median"], r["llmplug_ttft"][n]["median"]
        lines.append(f"{f'TTFT ms, {n}-token prompt':42s} {1e3 * s:12.1f} {'':13s} {1e3 * o:10.1f} "
                     f"{s / o:11.2f}x")
    lo, hi = r.get("batch_prompts", (32, 1024))
    for b, t in r["llmplug_batches"].items():
        ours = r["batch_output_tokens"][b] / t["median"]
        st = r.get("stock_batches", {}).get(b)
        theirs = r["batch_output_tokens"][b] / st["median"] if st else None
        ratio = f"{ours / theirs:11.2f}x" if theirs else f"{'-':>12s}"
        lines.append(f"{f'static batch {b} output tok/s ({lo}-{hi} in)':42s} {_cell(theirs, 12)} {'':13s} "
                     f"{ours:10.1f} {ratio}")
    lines.append(f"warm-up s: stock static+compile {_cell(r.get('stock_static_compile_warmup_s'), 0)}, "
                 f"llmplug {r['llmplug_warmup_s']:.1f}")
    ours, base = r["llmplug_vs_sdpa"], r["stock_eager_vs_sdpa"]
    lines.append(f"greedy agreement with stock sdpa, first 32 tokens of 16 prompts: llmplug "
                 f"{100 * ours['rows_identical']:.0f}% "
                 f"(teacher-forced argmax {100 * ours['teacher_forced_argmax']:.1f}%)"
                 f"; stock eager {100 * base['rows_identical']:.0f}% "
                 f"(teacher-forced {100 * base['teacher_forced_argmax']:.1f}%)")
    if "llmplug_peak_memory_bytes" in r:
        lines.append(f"llmplug peak memory {r['llmplug_peak_memory_bytes'] / 2**30:.1f} GiB (KV pool included)")
    return lines


def sample_lines(r: dict) -> list[str]:
    """Lines of the text sample ``r`` (``sample.run``): each prompt's greedy continuation from stock HF, then from
    llmplug, prompt included."""
    lines = [f"## text sample: {r['model']} ({r['params'] / 1e6:.1f}M parameters), greedy, {r['new_tokens']} new "
             f"tokens, {r['dtype']}"]
    for s in r["samples"]:
        verdict = "identical to stock HF"
        if not s["identical"]:  # expected now and then in bf16, where a near-tie can round either way
            verdict = (f"{'DIFFERS' if r['dtype'] == str(torch.float32) else 'differs'} from stock HF from new token "
                       f"{s['first_difference'] + 1} on")
        lines += [f"--- stock HF, prompt {s['prompt']!r}", s["prompt"] + s["stock"],
                  f"--- llmplug, prompt {s['prompt']!r} ({verdict})", s["prompt"] + s["llmplug"]]
    return lines


def kernel_table(r: dict) -> list[str]:
    """Lines of the attention microbenchmark table."""
    bw = r["ceilings"].get("read_bytes_per_s", 0)
    lines = ["## prefill attention (causal GQA 32q/8kv, D=128, bf16)",
             f"{'seq':>6s} {'llmplug TFLOP/s':>16s} {'SDPA TFLOP/s':>13s} {'ratio':>6s} {'rel err':>8s}"]
    for s, x in r.get("prefill_attention", {}).items():
        lines.append(f"{s:>6} {x['llmplug_tflops']:16.0f} {x['sdpa_tflops']:13.0f} {x['ratio_vs_sdpa']:6.2f} "
                     f"{x['rel_err_vs_sdpa']:8.1e}")
    lines += [f"## decode attention (paged, P=16), read bandwidth ceiling {bw / 1e12:.2f} TB/s",
              f"{'case':>14s} {'us':>8s} {'GB/s':>8s} {'% of read bw':>12s}"]
    for k, x in r.get("decode_attention", {}).items():
        frac = 100 * x.get("fraction_of_read_bw", 0)
        lines.append(f"{k:>14s} {1e6 * x['s']:8.1f} {x['gb_per_s']:8.0f} {frac:11.0f}%")
    return lines
