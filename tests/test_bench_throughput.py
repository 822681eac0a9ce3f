"""Serving benchmark harness: every workload at a tiny scale on CPU, its JSON, the floor arithmetic, the CLI."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from llmplug import cli
from llmplug.bench import report, throughput, workloads
from llmplug.bench.shapes import build
from llmplug.bench.workloads import ModelCost, floor
from llmplug.config import OptimizeConfig
from llmplug.engine.params import EngineConfig
from tests.tiny_models import reference_kernels

CEIL = {"read_bytes_per_s": 1e10, "bf16_flops_per_s": 1e11}  # made-up ceilings: CPU has none measured
RUN_KEYS = ("workload", "requests", "prompt_tokens", "output_tokens", "wall_s", "output_tok_s", "total_tok_s",
            "all_full_length", "errors", "stats", "floor", "fraction_of_floor")
STAT_KEYS = ("kv_utilisation_mean", "kv_utilisation_max", "kv_waste_max", "prefix_hit_rate", "preemptions",
             "goodput_req_s", "slo_attainment")


@pytest.fixture(scope="module", autouse=True)
def _references():
    with reference_kernels():
        yield


@pytest.fixture(scope="module")
def suite(tmp_path_factory, _references):
    """The whole suite at 1.5% scale; a 64-token step budget so (d)'s later requests find the cached prefix."""
    path = tmp_path_factory.mktemp("throughput") / "res.json"
    res = throughput.run("tiny-llama", "cpu", torch.float32, scale=0.015, rates=(50, 100), stock_requests=3,
                         engine_config=EngineConfig(max_num_batched_tokens=64),
                         optimize_config=OptimizeConfig(kv_num_blocks=256), ceilings=CEIL,
                         save=lambda r: report.save(r, path))
    return res, path


def test_suite_json_has_every_figure(suite):
    res, path = suite
    saved = json.loads(path.read_text())
    for key in ("device", "torch", "triton", "transformers", "commit", "command"):
        assert key in saved["env"]
    assert saved["ceilings"] == CEIL and saved["scale"] == 0.015
    assert set(saved["runs"]) == {"a", "b", "c", "d_prefix_cache", "d_no_prefix_cache"}
    assert set(saved["online"]) == {"50", "100"}
    for name, r in list(saved["runs"].items()) + list(saved["online"].items()):
        assert all(k in r for k in RUN_KEYS), name
        assert r["all_full_length"] and not r["errors"], name
        assert r["wall_s"] > 0 and r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"]
        for lat in ("ttft_s", "e2e_s", "tpot_s", "itl_s"):
            assert set(r["stats"][lat]) >= {"p50", "p95", "p99"}
        assert r["stats"]["ttft_s"]["p50"] > 0
        assert all(k in r["stats"] for k in STAT_KEYS)
        assert r["floor"]["floor_s"] > 0
        assert r["fraction_of_floor"] == pytest.approx(r["floor"]["floor_s"] / r["wall_s"])
    assert saved["runs"]["b"]["stats"]["tpot_s"]["p50"] > 0
    assert saved["runs"]["d_prefix_cache"]["stats"]["prefix_hit_rate"] > 0
    assert saved["runs"]["d_no_prefix_cache"]["stats"]["prefix_hit_rate"] == 0
    assert saved["summary"]["prefix_caching_speedup_d"] > 0
    for r in saved["online"].values():
        assert r["rate_req_s"] > 0 and "arrival_bound_s" in r["floor"]


def test_stock_generate_batch_runs_beside(suite):
    res, _ = suite
    stock = res["stock"]
    assert stock["requests"] == 3 and stock["finished"] == 3 and stock["all_full_length"] and not stock["errors"]
    assert stock["output_tokens"] == 3 * res["runs"]["a"]["output_tokens"] // res["runs"]["a"]["requests"]
    assert res["summary"]["speedup_vs_stock_a"] == pytest.approx(res["runs"]["a"]["output_tok_s"]
                                                                 / stock["output_tok_s"])
    ours = res["llmplug_generate_batch"]  # the same call after llmplug.optimize
    assert ours["requests"] == 3 and ours["all_full_length"] and not ours["errors"]
    assert res["summary"]["generate_batch_speedup_a"] > 0


def test_floor_in_the_run_matches_the_formula(suite):
    res, _ = suite
    cost = ModelCost(**res["cost"])
    wl = workloads.build("d", build("tiny-llama", torch.float32, "cpu").get_output_embeddings().weight.shape[0],
                         0.015)
    for label, cached in (("d_prefix_cache", wl.shared_prefix_len), ("d_no_prefix_cache", 0)):
        want = floor(cost, wl.prompt_lens, wl.output_lens, CEIL["read_bytes_per_s"], CEIL["bf16_flops_per_s"], 256,
                     [cached if i else 0 for i in range(len(wl.prompts))])
        assert res["runs"][label]["floor"]["floor_s"] == pytest.approx(want["floor_s"])


def test_floor_of_a_split_model_is_the_groups():
    """Under tensor parallelism (``devices=2``) the floor is the whole group's: both ceilings doubled; the JSON keeps
    one device's measured ceilings and says how many devices the floor counts, and so does the table."""
    res = throughput.run("tiny-llama", "cpu", torch.float32, ("b",), scale=0.015, stock=False, ceilings=CEIL,
                         optimize_config=OptimizeConfig(kv_num_blocks=256), devices=2)
    assert res["ceilings"] == CEIL and res["floor_devices"] == 2
    cost = ModelCost(**res["cost"])
    wl = workloads.build("b", build("tiny-llama", torch.float32, "cpu").get_output_embeddings().weight.shape[0],
                         0.015)
    want = floor(cost, wl.prompt_lens, wl.output_lens, 2 * CEIL["read_bytes_per_s"], 2 * CEIL["bf16_flops_per_s"],
                 EngineConfig().max_num_seqs)
    assert res["runs"]["b"]["floor"]["floor_s"] == pytest.approx(want["floor_s"])
    assert "of each of 2 GPUs" in "\n".join(throughput.table(res))


def test_table_and_plot(suite, tmp_path, monkeypatch):
    res, _ = suite
    text = "\n".join(throughput.table(res))
    for row in ("| a |", "| d_prefix_cache |", "| e @ 50 req/s |", "Stock HF", "Prefix caching on (d)"):
        assert row in text
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert throughput.plot(res, tmp_path / "none.png") is None
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    assert throughput.plot(res, tmp_path / "online.png").stat().st_size > 0


def test_model_cost_of_tiny_llama():
    # 4 layers of q 128x128, k/v 128x64, o 128x128, gate/up 128x256, down 256x128, two norms of 128; final norm;
    # lm_head 512x128 (untied); the input embedding is not read by a decode step.
    cost = ModelCost.of(build("tiny-llama", torch.float32, "cpu"))
    layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256 + 2 * 128
    assert cost.head_params == 512 * 128
    assert cost.body_params == 4 * layer + 128
    assert cost.weight_bytes == 4 * (4 * layer + 128 + 512 * 128)
    assert cost.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4
    assert cost.attn_flops_per_pair == 4 * 4 * 4 * 32


def test_floor_by_hand():
    cost = ModelCost(weight_bytes=1000, body_params=100, head_params=50, kv_bytes_per_token=10, attn_flops_per_pair=2)
    # prefill: r0 (4 tokens) 2*100*4 + 2*50 + 2*(1+2+3+4) = 920; r1 (2 tokens) 2*100*2 + 100 + 2*(1+2) = 506
    # decode, both at once: step 1 contexts 5 + 3 -> max(1080 B / 100, (2*2*150 + 2*8) / 1000) = 10.8 s;
    # step 2 r0 alone, context 6 -> 10.6 s
    got = floor(cost, [4, 2], [3, 2], read_bw=100, matmul_rate=1000, max_num_seqs=2)
    assert got["prefill_flops"] == 1426 and got["decode_steps"] == 2
    assert got["prefill_s"] == pytest.approx(1.426) and got["decode_s"] == pytest.approx(21.4)
    assert got["floor_s"] == pytest.approx(22.826)
    # one at a time: r0 contexts 5, 6 then r1 context 3 -> 10.5 + 10.6 + 10.3
    one = floor(cost, [4, 2], [3, 2], read_bw=100, matmul_rate=1000, max_num_seqs=1)
    assert one["decode_steps"] == 3 and one["decode_s"] == pytest.approx(31.4)
    # compute-bound at 10 FLOP/s: step 1 616 FLOPs -> 61.6 s, step 2 300 + 12 -> 31.2 s; prefill 142.6 s
    slow = floor(cost, [4, 2], [3, 2], read_bw=100, matmul_rate=10, max_num_seqs=2)
    assert slow["floor_s"] == pytest.approx(142.6 + 61.6 + 31.2)
    # r1 finds 1 token cached: 2*100*1 + 100 + 2*2 = 304 instead of 506
    assert floor(cost, [4, 2], [3, 2], 100, 1000, 2, cached=[0, 1])["prefill_flops"] == 920 + 304
    # r1 arrives at 50 s: at least 50 + its own prefill 0.506 + one step at context 3 (10.3)
    late = floor(cost, [4, 2], [3, 2], 100, 1000, 2, arrivals=[0.0, 50.0])
    assert late["arrival_bound_s"] == pytest.approx(60.806) and late["floor_s"] == pytest.approx(60.806)
    # a request of one output token decodes nothing
    assert floor(cost, [4], [1], 100, 1000, 2)["decode_steps"] == 0


def test_workloads_scale_and_seed():
    full = workloads.build("a", 1000)
    assert len(full.prompts) == 256 and set(full.output_lens) == {256}
    assert 32 <= min(full.prompt_lens) and max(full.prompt_lens) <= 1024
    assert workloads.build("a", 1000).prompts == full.prompts
    d = workloads.build("d", 1000, 0.5)
    assert len(d.prompts) == 128 and d.shared_prefix_len == 1000 and d.prompt_lens[0] == 1032
    assert all(p[:1000] == d.prompts[0][:1000] for p in d.prompts) and d.prompts[0][1000:] != d.prompts[1][1000:]
    assert (workloads.build("b", 1000).prompt_lens[0], workloads.build("b", 1000).output_lens[0]) == (32, 2048)
    assert (workloads.build("c", 1000).prompt_lens[0], workloads.build("c", 1000).output_lens[0]) == (4096, 32)
    slow, fast = workloads.online(1000, 2.0), workloads.online(1000, 8.0)
    assert len(slow.prompts) == 128 and slow.prompts == fast.prompts and slow.arrivals[0] == 0
    assert slow.arrivals[-1] == pytest.approx(4 * fast.arrivals[-1])
    assert 40 < slow.arrivals[-1] < 90  # 127 gaps of mean 0.5 s


def test_cli_and_script(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.json"
    argv = ["bench", "throughput", "--model", "tiny-llama", "--device", "cpu", "--workloads", "c", "--scale", "0.01",
            "--no-stock", "--kv-blocks", "64", "--out", str(out)]
    assert cli.main(argv) == 0
    saved = json.loads(out.read_text())
    assert set(saved["runs"]) == {"c"} and saved["runs"]["c"]["floor"] is None  # CPU: no ceilings, no floor
    assert "| c |" in out.with_suffix(".md").read_text()
    monkeypatch.setattr(sys, "argv", ["run_throughput.py", "--from-json", str(out)])
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "run_throughput.py"
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0
    assert "| c |" in capsys.readouterr().out


@pytest.mark.parametrize("split_build", [False, True])
def test_throughput_under_tensor_parallelism_on_cpu(tmp_path, split_build):
    """``llmplug bench throughput --tp 2`` relaunches itself under torchrun (two gloo processes): every rank serves the
    same workload through the split model (with ``--split-build`` made split from the start, as a shape too big for
    one GPU); rank 0 reports, every request at full length, the floor the whole model's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "tp.json"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "llmplug.cli", "bench", "throughput", "--tp", "2", "--workloads", "b",
                           "--scale", "0.02", "--out", str(out), *(["--split-build"] if split_build else [])],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["tp"] == 2 and res["runs"]["b"]["all_full_length"] and not res["runs"]["b"]["errors"]
    assert res["floor_devices"] == 2
    whole = ModelCost.of(build("tiny-llama", torch.float32, "cpu"))
    assert res["cost"]["weight_bytes"] == whole.weight_bytes
