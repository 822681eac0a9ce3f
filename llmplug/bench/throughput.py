"""Serving benchmark of :class:`llmplug.Engine`: offline workloads (a)-(d), Poisson arrivals (e), stock HF
``generate_batch`` on (a), every figure beside the physical floor of the run.

The physical floor of a run (dense decoder; see :func:`llmplug.bench.workloads.floor`) is the time an ideal engine
would need at the measured ceilings of the GPUs it runs on; ``fraction_of_floor = floor_s / wall_s`` says how close the
engine gets (1.0: as fast as the ideal engine).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import threading
import time
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

import llmplug

from ..config import OptimizeConfig
from ..engine.params import EngineConfig, SamplingParams
from ..engine.request import RequestOutput
from ..parallel.load import build_split
from ..state import state_of
from . import report, timing, workloads
from .shapes import SHAPES, build
from .workloads import ModelCost, Workload, floor

__all__ = ["add_arguments", "main", "run"]

_PCTS = ("p50", "p95", "p99")


def _floor_of(wl: Workload, cost: ModelCost, ceil: dict, max_num_seqs: int, prefix_cache: bool = False) -> dict | None:
    if not ceil.get("read_bytes_per_s") or not ceil.get("bf16_flops_per_s"):
        return None
    cached = [wl.shared_prefix_len if prefix_cache and i else 0 for i in range(len(wl.prompts))]
    return floor(cost, wl.prompt_lens, wl.output_lens, ceil["read_bytes_per_s"], ceil["bf16_flops_per_s"],
                 max_num_seqs, cached, wl.arrivals)


# ---- runs ----------------------------------------------------------------------------------------------------------
def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, do_sample=False, ignore_eos=True)


def _counters(engine: llmplug.Engine) -> tuple[int, int, int]:
    """Prefix-cache and preemption counters, which ``metrics.reset()`` leaves alone: diffed per run."""
    s = engine.blocks.stats
    return s.queried_tokens, s.hit_tokens, engine.scheduler.num_preemptions


def _record(engine, wl: Workload, outs: list[RequestOutput], wall: float, base: tuple[int, int, int], cost: ModelCost,
            ceil: dict, prefix_cache: bool = False) -> dict:
    stats = engine.stats()
    queried, hits, preempt = (a - b for a, b in zip(_counters(engine), base))
    stats.update(prefix_hit_rate=hits / queried if queried else 0.0, prefix_hit_tokens=hits, preemptions=preempt)
    got = [len(o.outputs[0].token_ids) for o in outs]
    out_tokens, prompt_tokens = sum(got), sum(wl.prompt_lens)
    fl = _floor_of(wl, cost, ceil, engine.config.max_num_seqs, prefix_cache)
    rec = {"workload": wl.key, "description": wl.description, "requests": len(outs), "prompt_tokens": prompt_tokens,
           "output_tokens": out_tokens, "wall_s": wall, "output_tok_s": out_tokens / wall,
           "total_tok_s": (out_tokens + prompt_tokens) / wall, "requests_per_s": len(outs) / wall,
           "all_full_length": got == wl.output_lens, "errors": [o.error for o in outs if o.error][:5],
           "engine_config": dataclasses.asdict(engine.config), "stats": stats, "floor": fl,
           "fraction_of_floor": fl["floor_s"] / wall if fl else None}
    if engine.runner.device.type == "cuda":
        rec["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return rec


def run_offline(engine: llmplug.Engine, wl: Workload, cost: ModelCost, ceil: dict) -> dict:
    """All of ``wl`` submitted at once, run to completion on the caller's thread."""
    base = _counters(engine)
    engine.metrics.reset()
    device = engine.runner.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    params = [_greedy(o) for o in wl.output_lens]
    timing.sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(wl.prompts, params, progress=True)
    wall = time.perf_counter() - t0
    return _record(engine, wl, outs, wall, base, cost, ceil, engine.config.enable_prefix_caching)


def run_online(engine: llmplug.Engine, wl: Workload, rate: float, cost: ModelCost, ceil: dict) -> dict:
    """``wl``'s requests added at their arrival times by a driver thread; the engine's background loop serves them."""
    engine.start()
    engine.blocks.reset_cache()  # every rate sends the same prompts: no hits from the previous rate
    base = _counters(engine)
    engine.metrics.reset()
    if engine.runner.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    done: dict[str, RequestOutput] = {}
    finished = threading.Event()
    bar = tqdm(total=len(wl.prompts), desc=f"online {rate:g} req/s", unit="req")

    def on_event(item) -> None:
        if isinstance(item, RequestOutput):
            done[item.request_id] = item
            bar.update(1)
            if len(done) == len(wl.prompts):
                finished.set()

    ids: list[str] = []
    failed: list[BaseException] = []
    t0 = time.perf_counter()

    def drive() -> None:
        try:
            for prompt, n, at in zip(wl.prompts, wl.output_lens, wl.arrivals):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                ids.append(engine.add_request(prompt, _greedy(n), on_event=on_event, stream=False))
        except BaseException as error:  # noqa: BLE001 - re-raised on the caller's thread
            failed.append(error)
            finished.set()

    driver = threading.Thread(target=drive, name="llmplug-bench-driver", daemon=True)
    driver.start()
    while not finished.wait(1.0):
        if not engine.is_running():
            raise RuntimeError("the engine's background loop stopped during the online run")
    if failed:
        raise RuntimeError(f"add_request failed at request {len(ids)} of the online run") from failed[0]
    wall = time.perf_counter() - t0
    driver.join()
    bar.close()
    rec = _record(engine, wl, [done[i] for i in ids], wall, base, cost, ceil)
    rec["rate_req_s"] = rate
    rec["arrival_span_s"] = wl.arrivals[-1] - wl.arrivals[0]
    return rec


def warm_up(model: torch.nn.Module, config: EngineConfig, wls: list[Workload], vocab: int) -> float:
    """Seconds spent compiling and capturing before timing, on a throwaway engine.

    ``Engine.warmup`` (every decode graph up to ``max_num_seqs``), one single-sequence prompt per prefill graph
    bucket on CUDA, and the first requests of each workload with 4 tokens out (Triton compiles of their shapes).
    """
    t0 = time.perf_counter()
    engine = llmplug.Engine(model, config)
    engine.warmup()
    runner = engine.runner
    g = torch.Generator().manual_seed(12345)
    if runner.device.type == "cuda":
        for t in runner.config.graph_prefill_tokens:
            if t + 2 <= runner.max_model_len:
                engine.generate([torch.randint(3, vocab, (t,), generator=g).tolist()], _greedy(2), progress=False)
    for wl in wls:
        head = wl.head(4)
        engine.generate(head.prompts, [_greedy(min(o, 4)) for o in head.output_lens], progress=False)
    timing.sync(runner.device)
    _drop(engine)
    del engine
    gc.collect()
    return time.perf_counter() - t0


def _drop(engine: llmplug.Engine) -> None:
    """Stop ``engine`` and give its cached KV blocks back to the pool the next engine shares."""
    engine.stop()
    engine.blocks.reset_cache()


def run_generate_batch(model: torch.nn.Module, wl: Workload, requests: int | None, cost: ModelCost, ceil: dict,
                       max_num_seqs: int) -> dict:
    """``model.generate_batch`` (HF's continuous-batching API) on the first ``requests`` of ``wl`` (all when None).

    Stock HF before ``llmplug.optimize``, llmplug's engine after it. On CPU the stock HF cache is sized to the
    requests (HF's default sizing fills gigabytes of static buffers there).
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    sub = wl.head(requests) if requests else wl
    new = max(sub.output_lens)
    device = next(model.parameters()).device
    cb = None
    if device.type != "cuda":
        page = getattr(ContinuousBatchingConfig(), "page_size", None) or 256
        blocks = sum(-(-(p + new) // page) for p in sub.prompt_lens) + 4
        cb = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=max(256, max(sub.prompt_lens)))

    def gen(prompts, n, bar=False):
        config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb,
                                    progress_bar=bar)

    gen(sub.prompts[:2], 4)  # warm-up: kernels and cuBLAS handles
    cache = getattr(getattr(state_of(model), "runner", None), "cache", None)
    if cache is not None:  # on llmplug: no prefix hits from the workload's earlier runs
        cache.blocks.reset_cache()
    timing.sync(device)
    t0 = time.perf_counter()
    res = gen(sub.prompts, new, bar=True)
    timing.sync(device)
    wall = time.perf_counter() - t0
    got = [len(o.generated_tokens) for o in res.values()]
    tokens = sum(got)
    fl = _floor_of(sub, cost, ceil, max_num_seqs)
    return {"workload": wl.key, "requests": len(sub.prompts), "of_requests": len(wl.prompts), "finished": len(res),
            "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "all_full_length": len(got) == len(sub.prompts) and min(got, default=0) == new,
            "errors": [o.error for o in res.values() if o.error][:5], "floor": fl,
            "fraction_of_floor": fl["floor_s"] / wall if fl else None}


def run(model_name: str, device: str, dtype: torch.dtype, keys: tuple[str, ...] = ("a", "b", "c", "d", "e"), *,
        scale: float = 1.0, rates: tuple[float, ...] = (2, 4, 8, 16), online_requests: int = 128, stock: bool = True,
        stock_requests: int | None = None, engine_config: EngineConfig | None = None,
        optimize_config: OptimizeConfig | None = None, ceilings: dict | None = None, save=None,
        split_build: bool = False, devices: int = 1) -> dict:
    """The whole serving suite on one model; ``save(results)`` is called after every phase (partial results).

    Args:
        keys: workloads to run, ``"a"`` ... ``"e"``; ``"d"`` runs with and without prefix caching.
        scale: fraction of every workload's requests and lengths.
        rates: requests/s of the online runs (``"e"``), ``online_requests * scale`` requests each.
        stock, stock_requests: stock HF ``generate_batch`` on (a), on its first ``stock_requests`` requests.
        ceilings: ``timing.ceilings`` result; measured here when None (empty on CPU: no floor then).
        split_build: build the named shape split over the ranks from the start (random slices: a shape too big for
            one device), optimized with ``optimize_config``; the floors stay the whole model's.
        devices: the GPUs the model is split over (tensor parallelism): the floors are the group's, at ``devices``
            times one device's measured ceilings (communication left out), so a run's fraction compares with TP=1's.
    """
    engine_config = engine_config or EngineConfig()
    save = save or (lambda _: None)
    one = timing.ceilings(device) if ceilings is None else ceilings
    ceil = {k: v * devices for k, v in one.items()}  # the floors' ceilings: the whole group's
    res: dict = {"env": report.environment(), "ceilings": one, "floor_devices": devices, "model": model_name,
                 "device": device, "dtype": str(dtype), "scale": scale, "workloads": list(keys),
                 "engine_config": dataclasses.asdict(engine_config), "runs": {}, "online": {}}
    if split_build:  # each rank makes only its slices; the whole model's cost from its meta-device twin
        with torch.device("meta"):
            whole = transformers.AutoModelForCausalLM.from_config(SHAPES[model_name](), dtype=dtype)
        overrides = {f.name: getattr(optimize_config, f.name) for f in dataclasses.fields(OptimizeConfig)
                     if f.name != "tensor_parallel"}
        model = build_split(SHAPES[model_name](), dtype, device, **overrides)
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    else:
        whole = model = build(model_name, dtype, device)
    vocab = whole.get_output_embeddings().weight.shape[0]
    cost = ModelCost.of(whole)
    del whole
    res["cost"] = dataclasses.asdict(cost)
    offline = {k: workloads.build(k, vocab, scale) for k in keys if k != "e"}
    online = [workloads.online(vocab, r, scale, requests=online_requests) for r in rates] if "e" in keys else []
    stock = stock and "a" in offline
    phases = 1 + len(offline) + bool(online) + 2 * stock  # warm-up, offline workloads, online, both generate_batch
    bar = tqdm(total=phases, desc=f"throughput {model_name}", unit="phase")

    def done(name: str) -> None:
        save(res)
        bar.set_postfix_str(name)
        bar.update(1)

    if stock:
        res["stock"] = run_generate_batch(model, offline["a"], stock_requests, cost, ceil, engine_config.max_num_seqs)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        done("stock")
    if not split_build:
        llmplug.optimize(model, optimize_config)
    res["optimize_config"] = dataclasses.asdict(state_of(model).runner.config)
    res["warmup_s"] = warm_up(model, engine_config, list(offline.values()) + online[:1], vocab)
    done("warm-up")
    for key, wl in offline.items():
        variants = [(key, engine_config)]
        if key == "d":
            variants = [(f"d_{name}", dataclasses.replace(engine_config, enable_prefix_caching=on))
                        for name, on in (("prefix_cache", True), ("no_prefix_cache", False))]
        for label, config in variants:
            engine = llmplug.Engine(model, config)
            res["runs"][label] = run_offline(engine, wl, cost, ceil)
            _drop(engine)
            del engine
            gc.collect()
        done(key)
    if online:
        engine = llmplug.Engine(model, engine_config)
        try:
            for rate, wl in zip(rates, online):
                res["online"][f"{rate:g}"] = run_online(engine, wl, rate, cost, ceil)
                save(res)
        finally:
            _drop(engine)
        done("e")
    if "stock" in res:  # the same call on the same requests, now on llmplug's engine (last: it keeps its own engine)
        res["llmplug_generate_batch"] = run_generate_batch(model, offline["a"], stock_requests, cost, ceil,
                                                           engine_config.max_num_seqs)
        done("llmplug generate_batch")
    bar.close()
    res["summary"] = summary(res)
    save(res)
    state_of(model).runner.release()  # under TP its graphs hold NCCL work: gone before the process group goes
    return res


def summary(res: dict) -> dict:
    """Speed-ups: llmplug's engine and llmplug's ``generate_batch`` vs stock HF on (a), prefix caching on (d)."""
    out = {}
    runs = res.get("runs", {})
    if "stock" in res and "a" in runs:
        out["speedup_vs_stock_a"] = runs["a"]["output_tok_s"] / res["stock"]["output_tok_s"]
    if "stock" in res and "llmplug_generate_batch" in res:
        out["generate_batch_speedup_a"] = res["llmplug_generate_batch"]["output_tok_s"] / res["stock"]["output_tok_s"]
    if "d_prefix_cache" in runs and "d_no_prefix_cache" in runs:
        out["prefix_caching_speedup_d"] = runs["d_prefix_cache"]["output_tok_s"] / runs["d_no_prefix_cache"][
            "output_tok_s"]
    return out


# ---- report ----------------------------------------------------------------------------------------------------------
def _f(x, spec: str = ".1f", mul: float = 1.0) -> str:
    return "-" if x is None else format(x * mul, spec)


def _pct(stats: dict, key: str, mul: float, spec: str = ".0f") -> str:
    return " / ".join(_f(stats[key][p], spec, mul) for p in _PCTS)


def table(res: dict) -> list[str]:
    """Markdown lines for BENCHMARKS.md: one row per run, online rates, speed-ups."""
    env, ceil = res["env"], res.get("ceilings", {})
    lines = [f"## Serving: {res['model']} ({res['dtype']}), scale {res['scale']:g}, {env['device']}",
             f"torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}, commit "
             f"{env['commit']}, command `{env['command']}`"]
    if ceil:
        devices = res.get("floor_devices", 1)
        group = f" of each of {devices} GPUs (tensor parallelism; communication left out)" if devices > 1 else ""
        lines.append(f"floor at the measured read bandwidth {ceil['read_bytes_per_s'] / 1e12:.2f} TB/s and matmul rate "
                     f"{ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s{group} (formula: `llmplug/bench/throughput.py` "
                     "floor)")
    head = ("| run | requests | in / out tokens | wall s | output tok/s | total tok/s | floor s | % of floor "
            "| TTFT P50/95/99 ms | TPOT P50/95/99 ms | ITL P50/95/99 ms | E2E P50/95/99 s | KV use mean/max "
            "| KV waste max | prefix hits | preemptions |")
    lines += ["", head, "|" + " --- |" * 16]
    rows = [(k, r) for k, r in res.get("runs", {}).items()]
    rows += [(f"e @ {k} req/s", r) for k, r in res.get("online", {}).items()]
    for name, r in rows:
        s, fl = r["stats"], r["floor"]
        lines.append(
            f"| {name} | {r['requests']} | {r['prompt_tokens']:,} / {r['output_tokens']:,} | {r['wall_s']:.2f} "
            f"| {r['output_tok_s']:,.0f} | {r['total_tok_s']:,.0f} | {_f(fl and fl['floor_s'], '.2f')} "
            f"| {_f(r['fraction_of_floor'], '.1f', 100)} | {_pct(s, 'ttft_s', 1e3)} | {_pct(s, 'tpot_s', 1e3, '.1f')} "
            f"| {_pct(s, 'itl_s', 1e3, '.1f')} | {_pct(s, 'e2e_s', 1, '.2f')} "
            f"| {100 * s['kv_utilisation_mean']:.0f}% / {100 * s['kv_utilisation_max']:.0f}% "
            f"| {100 * s['kv_waste_max']:.1f}% | {100 * s['prefix_hit_rate']:.1f}% | {s['preemptions']} |")
    if res.get("online"):
        slo = next(iter(res["online"].values()))["stats"]["slo"]
        lines += ["", f"Online (Poisson arrivals; SLO TTFT <= {slo['ttft_s']:g} s, TPOT <= {slo['tpot_s']:g} s):", "",
                  "| rate req/s | achieved req/s | output tok/s | goodput req/s | SLO attainment | % of floor |",
                  "|" + " --- |" * 6]
        for k, r in res["online"].items():
            s = r["stats"]
            lines.append(f"| {k} | {r['requests_per_s']:.2f} | {r['output_tok_s']:,.0f} | {s['goodput_req_s']:.2f} "
                         f"| {100 * s['slo_attainment']:.0f}% | {_f(r['fraction_of_floor'], '.1f', 100)} |")
    st, sm = res.get("stock"), res.get("summary", {})
    if st:
        lines += ["", f"Stock HF `generate_batch` on (a), {st['requests']} of {st['of_requests']} requests: "
                      f"{st['output_tok_s']:,.1f} output tok/s ({st['wall_s']:.1f} s, "
                      f"{_f(st['fraction_of_floor'], '.1f', 100)} % of its floor); llmplug on all of (a): "
                      f"{res['runs']['a']['output_tok_s']:,.1f}; speed-up {_f(sm.get('speedup_vs_stock_a'), '.2f')}x"]
        ours = res.get("llmplug_generate_batch")
        if ours:
            lines.append(f"The same `generate_batch` call on the same requests after `llmplug.optimize`: "
                         f"{ours['output_tok_s']:,.1f} output tok/s ({ours['wall_s']:.1f} s), speed-up "
                         f"{_f(sm.get('generate_batch_speedup_a'), '.2f')}x")
    if "prefix_caching_speedup_d" in sm:
        on, off = res["runs"]["d_prefix_cache"], res["runs"]["d_no_prefix_cache"]
        lines += ["", f"Prefix caching on (d): {on['output_tok_s']:,.0f} vs {off['output_tok_s']:,.0f} output tok/s "
                      f"off, speed-up {sm['prefix_caching_speedup_d']:.2f}x, hit rate "
                      f"{100 * on['stats']['prefix_hit_rate']:.1f}%"]
    return lines


def plot(res: dict, path: str | Path) -> Path | None:
    """Throughput vs P50/P95 latency across the online rates, as a PNG at ``path``; None without matplotlib."""
    if not res.get("online"):
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib, then run_throughput.py --from-json)")
        return None
    runs = list(res["online"].items())
    x = [r["output_tok_s"] for _, r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "e2e_s", "end-to-end latency"), (axes[1], "ttft_s", "time to first token")):
        for p, style in (("p50", "o-"), ("p95", "s--")):
            ax.plot(x, [r["stats"][key][p] for _, r in runs], style, label=p.upper())
        for (rate, r), xi in zip(runs, x):
            ax.annotate(f"{rate} req/s", (xi, r["stats"][key]["p50"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        ax.set(xlabel="output tokens/s", ylabel="seconds", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"llmplug Engine, {res['model']} ({res['dtype']}), {res['env']['device']}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- command line ----------------------------------------------------------------------------------------------------
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(p: argparse.ArgumentParser, default_out: str | None = None) -> None:
    """The options of ``benchmarks/run_throughput.py`` and ``llmplug bench throughput``."""
    p.add_argument("--model", help="shape name or local model directory; default llama-8b on CUDA, tiny-llama on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--workloads", nargs="+", choices=sorted(workloads.NAMES), default=sorted(workloads.NAMES),
                   help="a mixed, b decode-heavy, c prefill-heavy, d shared prefix (cache on and off), e online")
    p.add_argument("--scale", type=float, help="fraction of every workload's requests and lengths; default 1 on CUDA, "
                                               "0.05 on CPU")
    p.add_argument("--rates", nargs="+", type=float, default=[2, 4, 8, 16], help="online arrival rates, requests/s")
    p.add_argument("--online-requests", type=int, default=128, help="requests per online rate (before --scale)")
    p.add_argument("--no-stock", action="store_true", help="skip stock HF generate_batch on (a)")
    p.add_argument("--stock-requests", type=int, help="stock HF on the first N requests of (a) only (it is slow)")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default=EngineConfig.preemption_mode)
    p.add_argument("--greedy-ring", type=int, default=EngineConfig.greedy_ring,
                   help="greedy decode steps an all-greedy batch runs per host read (0: one step a call)")
    p.add_argument("--steps-ahead", type=int, default=EngineConfig.steps_ahead,
                   help="plain steps in flight before the host reads a step's tokens")
    p.add_argument("--slo-ttft", type=float, default=EngineConfig.slo_ttft_s, help="goodput TTFT target, s")
    p.add_argument("--slo-tpot", type=float, default=EngineConfig.slo_tpot_s, help="goodput TPOT target, s")
    p.add_argument("--kv-blocks", type=int, help="KV pool pages; default: sized from memory on CUDA, 2048 on CPU")
    p.add_argument("--kv-memory-fraction", type=float, default=OptimizeConfig.kv_memory_fraction)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--gemm-tuning", action="store_true",
                   help="OptimizeConfig(gemm_tuning=True): time cuBLASLt's algorithms for the graphs' GEMMs at warm-up")
    p.add_argument("--out", default=default_out, help="results JSON file, or a directory for a dated file name; the "
                                                      "markdown table and the online plot go next to it")
    p.add_argument("--commit", help="commit to record where git has no history (the device machine's copy)")
    p.add_argument("--tp", type=int, default=1, help="split the model over this many processes (GPUs): launches "
                                                     "itself under torchrun; every rank serves the same workloads, "
                                                     "rank 0 reports (no stock HF run)")
    p.add_argument("--split-build", action="store_true", help="with --tp: build the shape split from the start "
                                                                "(random slices; shapes too big for one GPU)")
    p.add_argument("--from-json", help="print the table and draw the plot of a saved result; run nothing")


def _paths(out: str | None, res: dict) -> tuple[Path, Path, Path] | None:
    if out is None:
        return None
    path = Path(out)
    if path.suffix != ".json":
        dev = res["env"]["device"].split()[-1].lower() if torch.device(res["device"]).type == "cuda" else "cpu"
        name = Path(res["model"]).name
        path = path / f"{time.strftime('%Y-%m-%d')}_{dev}_throughput_{name}.json"
    return path, path.with_suffix(".md"), path.with_name(path.stem + "_online.png")


def main(args: argparse.Namespace) -> int:
    """Run the suite (or re-render ``--from-json``); print the markdown table; write JSON, table and plot."""
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        print("\n".join(table(res)))
        drawn = plot(res, Path(args.from_json).with_name(Path(args.from_json).stem + "_online.png"))
        if drawn:
            print(f"plot: {drawn}")
        return 0
    rank = 0
    if args.tp > 1:
        from .tp import join_group, launch

        if "RANK" not in os.environ:  # relaunch under torchrun
            if getattr(args, "argv", None) is None:
                raise SystemExit("--tp runs through the llmplug command: llmplug bench throughput --tp N ...")
            return launch(args.tp, args.argv)
        rank = join_group(torch.device(args.device).type == "cuda")
        if torch.device(args.device).type == "cuda":
            args.device = f"cuda:{torch.cuda.current_device()}"
    cuda = torch.device(args.device).type == "cuda"
    model = args.model or ("llama-8b" if cuda else "tiny-llama")
    if args.split_build and (args.tp < 2 or model not in SHAPES):
        raise SystemExit(f"--split-build needs --tp of 2 or more and a named shape ({', '.join(sorted(SHAPES))}), got "
                         f"--tp {args.tp} --model {model}")
    dtype = _DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    scale = args.scale if args.scale is not None else (1.0 if cuda else 0.05)
    engine_config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                 preemption_mode=args.preemption_mode, slo_ttft_s=args.slo_ttft,
                                 slo_tpot_s=args.slo_tpot, greedy_ring=args.greedy_ring,
                                 steps_ahead=args.steps_ahead)
    blocks = args.kv_blocks if args.kv_blocks is not None else (None if cuda else 2048)
    optimize_config = OptimizeConfig(kv_num_blocks=blocks, kv_memory_fraction=args.kv_memory_fraction,
                                     max_model_len=args.max_model_len, gemm_tuning=args.gemm_tuning,
                                     tensor_parallel="auto" if args.tp > 1 else None)
    paths = None

    def save(res: dict) -> None:
        nonlocal paths
        if rank != 0:
            return
        if args.commit and not res["env"]["commit"]:
            res["env"]["commit"] = args.commit
        paths = paths or _paths(args.out, res)
        if paths:
            report.save(res, paths[0])

    torch.manual_seed(0)  # the same random weights on every rank
    res = run(model, args.device, dtype, tuple(args.workloads), scale=scale, rates=tuple(args.rates),
              online_requests=args.online_requests, stock=not args.no_stock and args.tp == 1,
              stock_requests=args.stock_requests, engine_config=engine_config, optimize_config=optimize_config,
              save=save, split_build=args.split_build, devices=args.tp)
    if args.tp > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        if rank != 0:
            return 0
        res["tp"] = args.tp
        save(res)
    lines = table(res)
    print("\n".join(lines))
    if not cuda:
        print("(CPU: llmplug runs its pure-PyTorch reference path here and no floor is measured; the figures that "
              "matter are on CUDA)")
    if paths:
        paths[1].write_text("\n".join(lines) + "\n")
        drawn = plot(res, paths[2])
        print(f"saved {paths[0]}, {paths[1]}" + (f", {drawn}" if drawn else ""))
    checked = list(res["runs"].items()) + list(res["online"].items())
    checked += [(k, res[k]) for k in ("stock", "llmplug_generate_batch") if k in res]
    bad = [k for k, r in checked if r["errors"] or not r["all_full_length"]]
    if bad:
        print(f"runs with failed or short requests: {bad}")
    return 1 if bad else 0
