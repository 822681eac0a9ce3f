"""``torch.compile(model, backend="llmplug")`` on the CPU (fp32): logits as the default backend's, greedy ``generate``
as stock's, every RMSNorm and gated activation of every layer matched, a user's own post-grad pass still running."""

import pytest
import torch
import torch._inductor.config as inductor_config

import llmplug.inductor
from tests.tiny_models import make_model, pad, prompts

# family -> RMSNorms a forward holds: input/post-attention norms a layer (+ q/k norms, + Gemma 2's two sandwich
# norms) and the final one
NORMS = {"llama": 2 * 2 + 1, "qwen3": 4 * 2 + 1, "gemma2": 4 * 3 + 1, "olmo2": 4 * 2 + 1, "granite": 2 * 2 + 1}


# of those, the ones whose input is the residual stream's add: every layer's input norm but the first layer's, and
# the final one (pre-norm families); OLMo 2 norms each sublayer's output before its add: only the final norm;
# Gemma 2: its pre-norms
RESIDUAL_NORMS = {"llama": 2 * 2, "qwen3": 2 * 2, "gemma2": 2 * 3, "olmo2": 1, "granite": 2 * 2}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)  # every graph compiled (and counted) here
    torch._dynamo.reset()
    llmplug.inductor.reset_report()
    yield
    torch._dynamo.reset()


def _model(family):
    torch.manual_seed(0)
    return make_model(family)


def _static_generate(model, ids, mask, new_tokens, backend=None):
    """Stock HF ``generate`` over a static cache, its decode steps compiled with ``backend`` (None: eager)."""
    from transformers import CompileConfig

    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
              cache_implementation="static")
    if backend is not None:
        config = CompileConfig(backend=backend)
        config._compile_all_devices = True  # HF compiles decode steps on CUDA only unless told
        kw["compile_config"] = config
    return model.generate(**kw)


@pytest.mark.parametrize("family", sorted(NORMS))
def test_logits_match_and_every_norm_is_found(family):
    model = _model(family)
    ids = torch.tensor(prompts(2, lengths=(9, 9), vocab=120))
    with torch.no_grad():
        expected = torch.compile(model)(input_ids=ids).logits
        torch._dynamo.reset()
        got = torch.compile(model, backend="llmplug")(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    report = llmplug.inductor.report()
    assert report["rms_norm"] == NORMS[family]
    assert report["add_rms_norm"] == RESIDUAL_NORMS[family]
    assert report["act_mul"] == model.config.num_hidden_layers  # one gated activation a layer (Gemma 2: GELU-tanh)


@pytest.mark.parametrize("family", sorted(NORMS))
def test_greedy_generate_equals_stock(family):
    """Every family of the acceptance list, batched prompts of two lengths: the forward compiled with the backend
    (dynamic cache), and HF's own static-cache compile with ``CompileConfig(backend="llmplug")``, give stock's greedy
    tokens (fp32)."""
    model = _model(family)
    ids, mask = pad(prompts(2, lengths=(5, 8), vocab=120))
    expected_static = _static_generate(model, ids, mask, 8)
    assert torch.equal(_static_generate(model, ids, mask, 8, "llmplug"), expected_static)
    torch._dynamo.reset()
    llmplug.inductor.reset_report()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    expected = model.generate(**kw)
    model.forward = torch.compile(model.forward, backend="llmplug")
    assert torch.equal(model.generate(**kw), expected)
    assert llmplug.inductor.report()["rms_norm"] >= NORMS[family]  # the first (static) graph's at least


def test_mode_and_options_reach_inductor(monkeypatch):
    """HF's ``CompileConfig`` asks for ``mode="reduce-overhead"`` by default: Dynamo hands a named backend ``mode``
    and ``options`` as keywords, which mean to llmplug's what they mean to Inductor (here: an unknown option is
    refused by Inductor's own check, a known one is applied)."""
    from torch._inductor import compile_fx

    seen = []
    real = compile_fx.compile_fx
    monkeypatch.setattr(compile_fx, "compile_fx",
                        lambda *a, **kw: seen.append(kw.get("config_patches")) or real(*a, **kw))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = torch.compile(_model("llama"))(input_ids=ids).logits
        torch._dynamo.reset()
        got = torch.compile(_model("llama"), backend="llmplug", mode="reduce-overhead")(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert any(patches and patches.get("triton.cudagraphs") is True for patches in seen)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="Unexpected optimization option no_such_option"):
        torch.compile(_model("llama"), backend="llmplug", options={"no_such_option": 1})(input_ids=ids)


def test_a_users_post_grad_pass_still_runs(monkeypatch):
    seen = []
    monkeypatch.setattr(inductor_config, "post_grad_custom_post_pass", lambda graph: seen.append(len(graph.nodes)))
    with torch.no_grad():
        torch.compile(_model("llama"), backend="llmplug")(input_ids=torch.tensor([[5, 6, 7, 8]]))
    assert seen and llmplug.inductor.report()["rms_norm"] == NORMS["llama"]


def test_other_norms_are_left_alone():
    """GPT-2's LayerNorms are not RMSNorms: nothing matches, the logits are the default backend's."""
    model = _model("gpt2")
    ids = torch.tensor(prompts(1, lengths=(7,), vocab=120))
    with torch.no_grad():
        expected = torch.compile(model)(input_ids=ids).logits
        torch._dynamo.reset()
        got = torch.compile(model, backend="llmplug")(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert llmplug.inductor.report().get("rms_norm", 0) == 0


def test_the_backend_is_registered_by_its_entry_point():
    """Dynamo finds ``llmplug`` among its backends through the installed ``torch_dynamo_backends`` entry point."""
    assert "llmplug" in torch._dynamo.list_backends(exclude_tags=())


def test_the_private_apis_it_uses_exist_and_a_missing_one_is_named(monkeypatch):
    from llmplug.inductor import backend

    backend.check_apis()  # this torch has every one
    monkeypatch.delattr(inductor_config, "post_grad_custom_post_pass")
    with pytest.raises(Exception, match="needs torch._inductor.config.post_grad_custom_post_pass"):
        torch.compile(_model("llama"), backend=llmplug.inductor.llmplug_backend)(input_ids=torch.tensor([[5, 6, 7]]))


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "olmo2"])
def test_bf16_graphs_with_casts_match_too(family):
    """In bf16 the norms carry casts (fp32 math, Llama's rounding before the weight, Gemma's and OLMo 2's at the end):
    matched all the same, and the logits stay within bf16 rounding of the default backend's."""
    torch.manual_seed(0)
    model = make_model(family, dtype=torch.bfloat16)
    ids = torch.tensor(prompts(2, lengths=(9, 9), vocab=120))
    with torch.no_grad():
        expected = torch.compile(model)(input_ids=ids).logits.float()
        torch._dynamo.reset()
        got = torch.compile(model, backend="llmplug")(input_ids=ids).logits.float()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    report = llmplug.inductor.report()
    assert report["rms_norm"] == NORMS[family] and report["add_rms_norm"] == RESIDUAL_NORMS[family]
    assert report["act_mul"] == model.config.num_hidden_layers


# family -> (projections a layer, merged groups a layer) at one token: q/k/v and gate/up merged (qwen2's q/k/v carry a
# bias: not merged; phi3's are fused weights already)
PROJECTIONS = {"llama": (7, 2), "qwen2": (7, 1), "phi3": (4, 0)}


@pytest.mark.parametrize("family", sorted(PROJECTIONS))
def test_few_row_projections_become_llmplug_gemvs(monkeypatch, family):
    """At one token every projection is a one-row product: each becomes ``llmplug::gemv`` (on CUDA; the CPU is let in
    here to exercise the matching, its op being the reference), the lm_head too; at 2-8 tokens ``llmplug::skinny_gemv``;
    at nine, none. At one token, sibling projections merge, every gate/up (two weights or one fused) takes its
    activation, and every GEMV whose input is a residual add's norm (all but the first layer's q/k/v, and the lm_head)
    takes the norm in its prologue."""
    from llmplug.inductor import gemv
    from llmplug.ops._triton import INTERPRET, cpu_kernels

    monkeypatch.setattr(gemv, "DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    model = make_model(family, dtype=torch.bfloat16)
    layers = model.config.num_hidden_layers
    per_layer, groups = PROJECTIONS[family]
    projections = per_layer * layers + 1
    for tokens, want in ((1, {"gemv": projections, "skinny_gemv": 0}), (3, {"gemv": 0, "skinny_gemv": projections}),
                         (9, {"gemv": 0, "skinny_gemv": 0})):
        ids = torch.tensor([[5, 9, 7, 11, 6, 8, 10, 12, 4][:tokens]])
        # the skinny kernel's bf16 tl.dot is not exact under Triton's interpreter: its op runs its reference here (the
        # GPU tests run the kernel); the one-row GEMV's interpreted kernel is exact
        with torch.no_grad(), cpu_kernels(INTERPRET and tokens == 1):
            expected = torch.compile(model)(input_ids=ids).logits
            torch._dynamo.reset()
            llmplug.inductor.reset_report()
            got = torch.compile(model, backend="llmplug")(input_ids=ids).logits
            torch._dynamo.reset()
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2,
                                   atol=2e-2 * expected.float().abs().max().item())  # bf16 roundings of other kernels
        report = llmplug.inductor.report()
        assert {key: report[key] for key in want} == want, tokens
        if tokens == 1:
            assert report["gemv_group"] == groups * layers and report["gated_gemv"] == layers
            assert report["norm_prologue"] == (2 * layers if groups != 1 else layers + 1)


def test_merged_projections_keep_greedy_tokens(monkeypatch):
    """fp32, batch 1: every decode step's projections merged, gated and normalised in the prologue (interpreted
    kernels on the CPU) and ``generate`` gives stock's tokens."""
    from llmplug.inductor import gemv

    monkeypatch.setattr(gemv, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(gemv, "DTYPES", (torch.float32,))
    model = _model("llama")
    ids = torch.tensor(prompts(1, lengths=(6,), vocab=120))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    expected = model.generate(**kw)
    model.forward = torch.compile(model.forward, backend="llmplug")
    assert torch.equal(model.generate(**kw), expected)
    report = llmplug.inductor.report()
    assert report["gemv_group"] >= 2 * model.config.num_hidden_layers and report["gated_gemv"] >= 1
    assert report["norm_prologue"] >= 1


def test_gemv_runs_under_programmatic_launch_and_skips_computed_weights(monkeypatch):
    """The compiled graph runs llmplug's kernels inside ``programmatic_launch`` (the GEMV may read its weight before
    its predecessors finish), so a weight the graph computes (here ``w * 2``) stays a matmul; a parameter's becomes
    ``llmplug::gemv``."""
    from llmplug.inductor import gemv
    from llmplug.ops import _triton
    from llmplug.ops import gemv as gemv_ops

    monkeypatch.setattr(gemv, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(gemv, "DTYPES", (torch.float32,))
    scopes = []
    launch = gemv_ops._launch
    monkeypatch.setattr(gemv_ops, "_launch", lambda *a, **kw: scopes.append(_triton._pdl_scope[-1]) or launch(*a, **kw))
    w = torch.randn(24, 16)

    def f(x, w):
        return x @ w.T, x @ (w * 2).T

    x = torch.randn(1, 16)
    got = torch.compile(f, backend="llmplug")(x, w)
    torch.testing.assert_close(got, f(x, w), rtol=1e-5, atol=1e-5)
    assert llmplug.inductor.report()["gemv"] == 1
    assert scopes == [True]


@pytest.mark.parametrize("family, lengths", [("llama", (6,)), ("llama", (3, 9, 5)), ("qwen3", (4, 8)),
                                              ("mistral", (5, 10))])
def test_static_cache_attention_becomes_llmplug_decode_attention(monkeypatch, family, lengths):
    """HF's ``generate(cache_implementation="static", compile_config=CompileConfig(backend="llmplug"))``, fp32: each
    decode step's SDPA over the static cache (its GQA copies, its mask: left padding, Mistral's sliding window)
    becomes ``llmplug::dense_decode_attention`` (interpreted kernel on the CPU), one a layer, with the layer's RoPE
    and cache stores folded in (``llmplug::rope_dense_decode_attention``) where the cache writes at one position, and
    the greedy tokens are stock's (Mistral's sliding-window cache compiles a second graph: a layer's match in each)."""
    from llmplug.inductor import attention

    monkeypatch.setattr(attention, "DEVICES", ("cuda", "cpu"))
    model = _model(family)
    ids, mask = pad(prompts(len(lengths), lengths=lengths, vocab=120))
    expected = _static_generate(model, ids, mask, 7)
    assert torch.equal(_static_generate(model, ids, mask, 7, "llmplug"), expected)
    report, layers = llmplug.inductor.report(), model.config.num_hidden_layers
    assert report["dense_decode_attention"] >= layers and report["dense_decode_attention"] % layers == 0
    # each with its RoPE and its cache stores folded in; not Mistral's: its sliding-window cache writes no index_put
    folded = report["dense_decode_attention"] if family != "mistral" else 0
    assert report["rope_dense_decode_attention"] == folded


@pytest.mark.parametrize("hidden, matched", [(float("-inf"), 1), (-65536.0, 1), (-100.0, 0)])
def test_decode_attention_mask_as_a_bias(monkeypatch, hidden, matched):
    """HF's repeat_kv + SDPA with the mask as a bias ``where(mask, 0, hidden)``, as SDPA's CUDA kernels get it (bf16:
    -65536): matched where ``hidden`` hides a key as -inf does, left to SDPA where it is a real bias; same output."""
    import torch.nn.functional as F

    from llmplug.inductor import attention

    monkeypatch.setattr(attention, "DEVICES", ("cuda", "cpu"))

    def f(q, k, v, mask):
        kr, vr = (t[:, :, None].expand(2, 2, 3, 11, 16).reshape(2, 6, 11, 16) for t in (k, v))
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=torch.where(mask, 0.0, hidden), scale=0.3)

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 1, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)
    mask = torch.rand(2, 1, 1, 11) < 0.6
    mask[..., 0] = True
    got = torch.compile(f, backend="llmplug")(q, k, v, mask)
    torch.testing.assert_close(got, f(q, k, v, mask), rtol=1e-5, atol=1e-5)
    assert llmplug.inductor.report()["dense_decode_attention"] == matched


_WARM_CACHE_SCRIPT = """
import torch
import torch.nn.functional as F
import llmplug.inductor
from llmplug.inductor import attention

attention.DEVICES = ("cuda", "cpu")

def f(q, k, v):
    kr, vr = (t[:, :, None].expand(2, 2, 3, 11, 16).reshape(2, 6, 11, 16) for t in (k, v))
    return F.scaled_dot_product_attention(q, kr, vr, scale=0.3)

torch.manual_seed(0)
q, k, v = torch.randn(2, 6, 1, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)
compiled = torch.compile(f, backend=llmplug.inductor.llmplug_backend)  # the callable: no install needed
torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=1e-5, atol=1e-5)
print(llmplug.inductor.report().get("dense_decode_attention", 0))
"""


def test_a_graph_served_from_inductors_cache_finds_llmplugs_ops(tmp_path):
    """Two fresh processes compile the same decode attention with Inductor's FX cache in one folder: the second is
    served the first's code, which calls ``llmplug::dense_decode_attention`` though no pass ran to import it (on the
    H100 this raised AttributeError for ``rope_dense_decode_attention`` on a warm machine)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "TRITON_INTERPRET": "1"}
    runs = [subprocess.run([sys.executable, "-c", _WARM_CACHE_SCRIPT], env=env, capture_output=True, text=True)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert [run.stdout.split()[-1] for run in runs] == ["1", "0"]  # compiled once, then served from the cache


def test_every_op_the_passes_emit_is_registered_by_importing_them():
    """Each ``torch.ops.llmplug.NAME`` the pattern modules name resolves once the backend has imported its passes,
    in a fresh process (what a graph served from Inductor's cache needs)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    folder = Path(llmplug.inductor.__file__).parent
    names = sorted({n for f in folder.glob("*.py") for n in re.findall(r"torch\.ops\.llmplug\.(\w+)", f.read_text())})
    assert "rope_dense_decode_attention" in names and len(names) >= 10
    check = f"import torch, llmplug.inductor.passes; print([n for n in {names!r} if not hasattr(torch.ops.llmplug, n)])"
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr[-2000:]
