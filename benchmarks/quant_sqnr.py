"""SQNR of every linear :func:`llmplug.quantize` quantizes, on a trained model's weights and real activations (issue 4).

The model loads in fp32 on the CPU. For each method, a copy of it goes through ``llmplug.quantize`` (so the linears
measured are exactly the ones llmplug picks, quantized by the code it runs), and each quantized linear's weight is
dequantized back to fp32 ``Wq``. Two figures per linear, against the fp32 original ``W``:

* weight SQNR: ``sqnr_db(W, Wq)``;
* output SQNR: ``sqnr_db(x @ W^T, x @ Wq^T)`` (products in fp64, bias left out), where ``x`` are the inputs that
  linear really received while the fp32 model ran over held-out text: the first tokens of a few files of the
  training script's held-out split of the running interpreter's stdlib (``scripts/train_small_models.py``; the
  committed models were trained on Python 3.11.7's stdlib), tokenized with the model's tokenizer.

Bars: ``tests/tolerances.py`` ``QUANT_SQNR_DB`` (the issue's int8 >= 35 dB, int4 g128 >= 18 dB; fp8 its own). int4
leaves linears whose input width the group size does not divide unquantized; they are listed as skipped. Exits 1 when
a method's smallest SQNR misses its bar.

    python benchmarks/quant_sqnr.py [--model models/llmplug-stdlib-small] [--methods int8 int4 fp8] \
        [--group-size 128] [--tokens 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import llmplug  # noqa: E402
from llmplug.bench import report  # noqa: E402
from llmplug.bench.sample import default_model  # noqa: E402
from llmplug.quant.formats import sqnr_db  # noqa: E402
from llmplug.quant.quantize import QUANT_ATTR, _excluded  # noqa: E402
from tests.tolerances import QUANT_SQNR_DB  # noqa: E402

TRAIN_SCRIPT = ROOT / "scripts" / "train_small_models.py"


def load(path: str | Path) -> tuple[nn.Module, object]:
    """``(model in fp32 on the CPU, eval mode; its tokenizer)`` from a local model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def held_out_ids(tokenizer, tokens: int = 512, pieces: int = 4) -> torch.Tensor:
    """``(pieces, tokens // pieces)`` int64: the first tokens (``<|bos|>`` first) of ``pieces`` held-out stdlib files,
    evenly spaced through the training script's validation split, among the files long enough."""
    spec = importlib.util.spec_from_file_location("train_small_models", TRAIN_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    _, val = script.split_files(script.stdlib_files())
    per = tokens // pieces
    rows = [ids for ids in (tokenizer(text, truncation=True, max_length=per)["input_ids"] for _, text in val)
            if len(ids) == per]
    if len(rows) < pieces:
        raise ValueError(f"only {len(rows)} held-out files have {per} tokens; ask for fewer tokens or pieces")
    return torch.tensor([rows[i * len(rows) // pieces] for i in range(pieces)])


@torch.inference_mode()
def capture_inputs(model: nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run ``model`` on ``input_ids: (B, L)``; return each ``nn.Linear``'s input as ``(B * L, K)``, by module name."""
    seen, hooks = {}, []
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear:
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(name, args[0].reshape(-1, m.in_features).clone())))
    try:
        model(input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.inference_mode()
def linear_sqnrs(model: nn.Module, method: str, group_size: int = 128, inputs: dict[str, torch.Tensor] | None = None,
                 exclude: tuple[str, ...] = ("lm_head",)) -> dict:
    """Quantize a copy of ``model`` with ``llmplug.quantize(copy, method, group_size, exclude)`` and measure every
    linear it quantized against ``model``'s (which is left as it is).

    Args:
        model: the fp32 reference.
        method, group_size, exclude: as in :func:`llmplug.quantize`.
        inputs: ``{name: (T, K)}`` real inputs of the linears (:func:`capture_inputs`); without them there is no
            output SQNR.

    Returns:
        ``{"method", "group_size", "bar_db", "rows": [{"name", "shape": [N, K], "weight_sqnr_db",
        "output_sqnr_db"}], "skipped": [{"name", "shape"}] (not excluded, yet left unquantized: int4's group size
        does not divide K), "excluded": [names], "min_weight_sqnr_db", "min_output_sqnr_db", "passes"}``.
    """
    quantized = llmplug.quantize(copy.deepcopy(model), method, group_size, exclude)
    names = quantized.__dict__[QUANT_ATTR]["modules"]
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    rows = []
    for name in names:
        w, wq = linears[name].weight.float(), quantized.get_submodule(name).dequantize()
        row = {"name": name, "shape": list(w.shape), "weight_sqnr_db": sqnr_db(w, wq), "output_sqnr_db": None}
        if inputs is not None and name in inputs:
            x = inputs[name].double()
            row["output_sqnr_db"] = sqnr_db(x @ w.double().t(), x @ wq.double().t())
        rows.append(row)
    excluded = [n for n in linears if _excluded(n, tuple(exclude))]
    skipped = [{"name": n, "shape": [m.out_features, m.in_features]} for n, m in linears.items()
               if n not in names and n not in excluded]
    bar = QUANT_SQNR_DB[method]
    mins = {}
    for key in ("weight_sqnr_db", "output_sqnr_db"):
        values = [r[key] for r in rows if r[key] is not None]
        mins[key] = min(values) if values else None
    passes = bool(rows) and all(v is None or v >= bar for v in mins.values())
    return {"method": method, "group_size": group_size if method == "int4" else None, "bar_db": bar, "rows": rows,
            "skipped": skipped, "excluded": excluded, "min_weight_sqnr_db": mins["weight_sqnr_db"],
            "min_output_sqnr_db": mins["output_sqnr_db"], "passes": passes}


def _db(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(results: list[dict]) -> list[str]:
    """One row per linear (weight / output SQNR in dB for each method), then each method's minima against its bar."""
    cells: dict[str, dict[str, str]] = {}
    shapes: dict[str, list[int]] = {}
    for res in results:
        for r in res["rows"]:
            shapes[r["name"]] = r["shape"]
            cells.setdefault(r["name"], {})[res["method"]] = f"{_db(r['weight_sqnr_db'])} / {_db(r['output_sqnr_db'])}"
        for s in res["skipped"]:
            shapes[s["name"]] = s["shape"]
            cells.setdefault(s["name"], {})[res["method"]] = "skipped"
    methods = [r["method"] for r in results]
    width = max([len(n) for n in cells] + [6])
    lines = [f"{'linear':{width}s} {'N x K':>11s}" + "".join(f" {m + ' W/out dB':>15s}" for m in methods)]
    for name, by_method in cells.items():
        n, k = shapes[name]
        lines.append(f"{name:{width}s} {f'{n}x{k}':>11s}" + "".join(f" {by_method.get(m, '-'):>15s}" for m in methods))
    for res in results:
        label = res["method"] + (f" g{res['group_size']}" if res["group_size"] else "")
        lines.append(f"{label}: {len(res['rows'])} linears, min weight SQNR {_db(res['min_weight_sqnr_db'])} dB, "
                     f"min output SQNR {_db(res['min_output_sqnr_db'])} dB, bar {res['bar_db']:.0f} dB: "
                     f"{'PASS' if res['passes'] else 'FAIL'}"
                     + (f"; {len(res['skipped'])} skipped" if res["skipped"] else "")
                     + (f"; excluded {', '.join(res['excluded'])}" if res["excluded"] else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model() or ROOT / "models" / "llmplug-stdlib-small"))
    ap.add_argument("--methods", nargs="+", default=list(llmplug.quant.METHODS), choices=llmplug.quant.METHODS)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=512, help="held-out tokens run through the model")
    ap.add_argument("--pieces", type=int, default=4, help="held-out files the tokens come from (the batch size)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    model, tok = load(args.model)
    ids = held_out_ids(tok, args.tokens, args.pieces)
    inputs = capture_inputs(model, ids)
    results = [linear_sqnrs(model, m, args.group_size, inputs) for m in args.methods]
    print(f"## {Path(args.model).name}: fp32 weights, inputs from {ids.numel()} held-out tokens "
          f"({ids.shape[0]} x {ids.shape[1]}); SQNR vs fp32 in dB, weight / output")
    print("\n".join(table(results)))
    if args.json:
        report.save({**report.environment(), "model": args.model, "tokens": ids.numel(), "results": results},
                    args.json)
    return 0 if all(r["passes"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
