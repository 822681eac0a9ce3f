"""EAGLE-3 heads: loading the reference format, the head's forward against a from-scratch re-implementation, the
runner's capture of layer inputs against HF's ``output_hidden_states``, and greedy ``generate`` with a head as the
assistant token-identical to plain greedy (fp32 CPU, references)."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import llmplug
from llmplug.engine import generate_spec
from llmplug.engine.sequences import SequenceBatch
from llmplug.spec.adaptive import AdaptiveK
from llmplug.spec.eagle3 import HeadCache, load_eagle3
from llmplug.state import state_of
from tests.tiny_models import make_model, pad, prompts, reference_kernels

LAYERS = 8  # the tiny target's: EAGLE-3 reads the inputs of layers (2, 4, 5)
DRAFT_VOCAB = 48
COMMITTED = Path(__file__).resolve().parents[2] / "models" / "llmplug-stdlib-small-eagle3"


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    monkeypatch.setitem(generate_spec.RIDGE_TOKENS, "cpu", 1e9)  # speculate at every step, as on a GPU
    with reference_kernels():
        yield


def _head_config(hidden=64, vocab=128) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 80, "rms_norm_eps": 1e-6,
            "rope_theta": 5000.0, "max_position_embeddings": 256, "num_hidden_layers": 1, "vocab_size": vocab,
            "draft_vocab_size": DRAFT_VOCAB, "torch_dtype": "float32"}


def _head_tensors(config: dict, target_hidden: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in the reference layout (larger than init, so drafts vary)."""
    g = torch.Generator().manual_seed(seed)
    h, heads, kv, inter = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                               "intermediate_size"))
    d = h // heads

    def w(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1]) * 2.0

    ids = torch.randperm(config["vocab_size"], generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[ids] = True
    out = {"fc.weight": w(h, 3 * target_hidden), "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h),
           "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h), "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h),
           "midlayer.self_attn.o_proj.weight": w(h, heads * d), "midlayer.mlp.gate_proj.weight": w(inter, h),
           "midlayer.mlp.up_proj.weight": w(inter, h), "midlayer.mlp.down_proj.weight": w(h, inter),
           "lm_head.weight": w(DRAFT_VOCAB, h), "d2t": ids - torch.arange(DRAFT_VOCAB), "t2d": t2d}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        out[f"{name}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    return out


def _save(path: Path, config: dict, tensors: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, path / "model.safetensors")
    return path


def _target():
    return make_model("llama", num_hidden_layers=LAYERS)


class _Reference:
    """The head written out from its tensors, one position at a time, in float64: every key and value of the
    positions so far, attention by an explicit softmax."""

    def __init__(self, config: dict, tensors: dict, embed: torch.Tensor) -> None:
        self.t = {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}
        self.embed, self.eps, self.theta = embed.double(), config["rms_norm_eps"], config["rope_theta"]
        self.heads, self.kv = config["num_attention_heads"], config["num_key_value_heads"]
        self.dim = config["hidden_size"] // self.heads
        self.keys, self.values = [], []

    def _norm(self, x, name):
        return self.t[f"{name}.weight"] * x / torch.sqrt(x.pow(2).mean() + self.eps)

    def _rope(self, x, position):  # x (heads, D)
        half = self.dim // 2
        angles = position / self.theta ** (torch.arange(half, dtype=torch.float64) * 2 / self.dim)
        cos, sin = torch.cos(angles).repeat(2), torch.sin(angles).repeat(2)
        return x * cos + torch.cat([-x[:, half:], x[:, :half]], dim=1) * sin

    def step(self, token: int, feature: torch.Tensor) -> torch.Tensor:
        """The next position: ``token``'s embedding and ``feature (H,)`` -> hidden ``(H,)`` before the final norm."""
        position, t = len(self.keys), self.t
        x = torch.cat([self._norm(self.embed[token], "midlayer.input_layernorm"),
                       self._norm(feature, "midlayer.hidden_norm")])
        q = self._rope((t["midlayer.self_attn.q_proj.weight"] @ x).view(self.heads, self.dim), position)
        self.keys.append(self._rope((t["midlayer.self_attn.k_proj.weight"] @ x).view(self.kv, self.dim), position))
        self.values.append((t["midlayer.self_attn.v_proj.weight"] @ x).view(self.kv, self.dim))
        group = self.heads // self.kv
        keys = torch.stack(self.keys).repeat_interleave(group, dim=1)  # (P, heads, D)
        values = torch.stack(self.values).repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,phd->hp", q, keys) / math.sqrt(self.dim), dim=-1)
        hidden = feature + t["midlayer.self_attn.o_proj.weight"] @ torch.einsum("hp,phd->hd", weights, values).flatten()
        normed = self._norm(hidden, "midlayer.post_attention_layernorm")
        gate, up = t["midlayer.mlp.gate_proj.weight"] @ normed, t["midlayer.mlp.up_proj.weight"] @ normed
        return hidden + t["midlayer.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)

    def token(self, hidden: torch.Tensor) -> int:
        draft = int((self.t["lm_head.weight"] @ self._norm(hidden, "norm")).argmax())
        return draft + int(self.t["d2t"][draft])

    def drafts(self, history: list[int], aux: torch.Tensor, k: int) -> tuple[list[int], torch.Tensor]:
        """From scratch: every verified position ``p < len(aux)`` (token ``p + 1``, ``fc(aux[p])``), then ``k``
        drafts -> (drafts, hidden states of the verified positions)."""
        self.keys, self.values = [], []
        features = aux.double() @ self.t["fc.weight"].T
        hiddens = torch.stack([self.step(history[p + 1], features[p]) for p in range(len(aux))])
        hidden, out = hiddens[-1], []
        for j in range(k):
            out.append(self.token(hidden))
            if j < k - 1:
                hidden = self.step(out[-1], hidden)
        return out, hiddens


def test_head_forward_and_proposals_match_a_from_scratch_head(tmp_path):
    """Batched rows of different lengths over several rounds (drafts partly accepted, some rows skipped a round):
    every proposal equals the from-scratch head's on the row's whole history, and the head's hidden states equal its
    hidden states."""
    target = _target()
    config = _head_config()
    tensors = _head_tensors(config)
    proposer = load_eagle3(_save(tmp_path / "head", config, tensors), target)
    reference = _Reference(config, tensors, target.get_input_embeddings().weight.detach())
    g = torch.Generator().manual_seed(1)
    histories = [p + [5] for p in prompts(3, lengths=(6, 13, 3))]  # prompt + the first token
    auxes = [torch.randn(len(h) - 1, 3 * 64, generator=g) for h in histories]
    proposer.observe([0, 1, 2], auxes)
    k = 4
    for round_rows, accept in (([0, 1, 2], [0, 2, 4]), ([0, 2], [3, None, 1]), ([0, 1, 2], [1, 0, 2])):
        drafts = proposer.propose(round_rows, histories, k)
        for r, got in zip(round_rows, drafts):
            want, _ = reference.drafts(histories[r], auxes[r], k)
            assert got == want, (r, got, want)
        for r, n in enumerate(accept):  # n drafts accepted, then the target's own token; None: not verified
            if n is None:
                continue
            new = (drafts[round_rows.index(r)][:n] if r in round_rows else []) + [int(torch.randint(3, 128, (1,),
                                                                                                     generator=g))]
            fresh = torch.randn(len(new), 3 * 64, generator=g)
            histories[r] += new
            auxes[r] = torch.cat([auxes[r], fresh])
            proposer.observe([r], [fresh])
    # the hidden states of one row's verified positions, through the head's forward directly
    head, history, aux = proposer.head, histories[1], auxes[1]
    cache = HeadCache(head)
    cache.reserve(1, len(aux))
    positions = torch.arange(len(aux))[None]
    embeds = target.get_input_embeddings()(torch.tensor(history[1:])[None])
    with torch.no_grad():
        hidden = head(embeds, head.fc(aux[None]), positions, cache, None, len(aux))[0]
    _, want = reference.drafts(history, aux, 1)
    torch.testing.assert_close(hidden.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, layers", [("llama", (2, 4, 5)), ("llama", (0, 7, 0)), ("olmo2", (1, 0, 1))])
def test_capture_aux_equals_output_hidden_states(family, layers):
    """The runner's captured layer inputs (fused llama; HF's own forward for olmo2) at every prompt position of a
    packed multi-row prefill and at a decode step equal HF's ``output_hidden_states`` at those indices."""
    stock = make_model(family, **({"num_hidden_layers": LAYERS} if family == "llama" else {}))
    fast = llmplug.optimize(copy.deepcopy(stock))
    runner = state_of(fast).runner
    rows = prompts(3, lengths=(5, 11, 3))
    ids, mask = pad(rows)
    runner.capture_aux(layers)
    seqs = SequenceBatch(runner, ids, mask, 32, prefix_cache=False)
    try:
        logits = seqs.prefill()
        nxt = logits.argmax(-1)
        seqs.decode(nxt)
        decoded = runner.aux_hidden
    finally:
        runner.capture_aux(None)
        seqs.release()
    assert runner.aux_hidden is None
    for r, (row, got) in enumerate(zip(rows, seqs.prefill_aux())):
        full = torch.tensor([row + [int(nxt[r])]])
        with torch.no_grad():
            states = stock(input_ids=full, output_hidden_states=True).hidden_states
        want = torch.cat([states[i][0] for i in layers], dim=-1)
        torch.testing.assert_close(got, want[:-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(decoded[r], want[-1], rtol=1e-4, atol=1e-4)


def test_capture_aux_rejects_layers_outside_the_model():
    runner = state_of(llmplug.optimize(make_model("llama"))).runner
    with pytest.raises(ValueError, match=r"aux layers \[2\] outside the model's layers 0..1"):
        runner.capture_aux((0, 2))


def _check_generate(stock, fast, head_dir: Path, ids, mask, k: int) -> None:
    """``fast`` with the head as assistant gives ``stock``'s greedy tokens; the proposer saw the target's layer inputs
    at every verified position, in order (against HF's hidden states of the final sequences); the same proposer
    serves a second call, and plain calls still follow."""
    proposer = llmplug.load_eagle3(head_dir, fast)
    seen: dict[int, list[torch.Tensor]] = {}
    observe = proposer.observe

    def recording(rows, aux):
        for r, a in zip(rows, aux):
            seen.setdefault(r, []).append(a.clone())
        observe(rows, aux)

    proposer.observe = recording
    new_tokens = 20
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
              pad_token_id=0)
    expected = stock.generate(**kw)
    assert torch.equal(fast.generate(**kw, assistant_model=proposer, num_assistant_tokens=k), expected)
    stats = llmplug.spec_stats(fast)
    assert stats.drafted > 0 and stats.steps > 0
    assert state_of(fast).runner.aux_layers == ()  # capture is off again
    for r in range(len(ids)):
        row = expected[r][mask[r].bool().tolist() + [True] * new_tokens]
        observed = torch.cat(seen[r])
        assert len(observed) >= len(row) - 1
        with torch.no_grad():
            states = stock(input_ids=row[None], output_hidden_states=True).hidden_states
        want = torch.cat([states[i][0] for i in (2, 4, 5)], dim=-1)
        torch.testing.assert_close(observed[:len(row) - 1], want[:-1], rtol=1e-4, atol=1e-4)
    assert torch.equal(fast.generate(**kw, assistant_model=proposer, num_assistant_tokens=k), expected)
    assert torch.equal(fast.generate(**kw), expected)


@pytest.mark.parametrize("k", [1, 4])
def test_generate_with_head_equals_greedy(tmp_path, k):
    """Batched prompts of different lengths (CPU: every step eager)."""
    stock = _target()
    fast = llmplug.optimize(copy.deepcopy(stock))
    config = _head_config()
    ids, mask = pad(prompts(3, lengths=(5, 17, 9)))
    _check_generate(stock, fast, _save(tmp_path / "head", config, _head_tensors(config)), ids, mask, k)


def test_sampling_with_head(tmp_path):
    """Sampled calls speculate with a head too (its greedy drafts verified by rejection sampling; the distribution is
    tests/spec/test_generate_spec.py's): they run, and the rows keep their lengths."""
    fast = llmplug.optimize(_target())
    config = _head_config()
    proposer = llmplug.load_eagle3(_save(tmp_path / "head", config, _head_tensors(config)), fast)
    ids, mask = pad(prompts(3, lengths=(5, 17, 9)))
    torch.manual_seed(0)
    out = fast.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.7,
                        eos_token_id=None, pad_token_id=0, assistant_model=proposer, num_assistant_tokens=3)
    assert out.shape == (3, ids.shape[1] + 12) and llmplug.spec_stats(fast).drafted > 0


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_generate_with_head_on_cuda_graphs(tmp_path, batch):
    """On CUDA (fp32, graphs on): the prefill graph (one prompt) and the verify graphs keep the captured layer
    inputs in their buffers, under keys that name the layers, beside the plain graphs."""
    stock = _target().cuda()
    fast = llmplug.optimize(copy.deepcopy(stock), graph_batch_sizes=(1, 4, 8))
    config = _head_config()
    ids, mask = pad(prompts(batch, lengths=(17, 5, 9)))
    _check_generate(stock, fast, _save(tmp_path / "head", config, _head_tensors(config)), ids.cuda(), mask.cuda(),
                    4)
    keys, aux, bucket = set(state_of(fast).runner._graphs), (2, 4, 5), 1 if batch == 1 else 4
    assert any(key[:2] == ("verify", bucket) and key[-1] == aux for key in keys)  # the verify steps
    assert ("greedy", bucket) in keys  # the plain call's
    if batch == 1:  # one prompt: a prefill graph with the capture and one without
        assert {("prefill", 64), ("prefill", 64, aux)} <= keys


def test_load_errors(tmp_path):
    target = _target()
    config = _head_config()
    tensors = _head_tensors(config)
    with pytest.raises(FileNotFoundError, match="model.safetensors is missing"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text(json.dumps(config))
        load_eagle3(tmp_path / "empty", target)
    narrow = _save(tmp_path / "narrow", {**config, "target_hidden_size": 32}, _head_tensors(config, target_hidden=32))
    with pytest.raises(ValueError, match="fuses target states of width 32 .* hidden_size is 64"):
        load_eagle3(narrow, target)
    with pytest.raises(ValueError, match="vocab_size=128 but the model embeds 256"):
        load_eagle3(_save(tmp_path / "ok", config, tensors), make_model("llama", num_hidden_layers=LAYERS,
                                                                        vocab_size=256))
    with pytest.raises(ValueError, match=r"lacks \['norm.weight'\]"):
        load_eagle3(_save(tmp_path / "partial", config, {k: v for k, v in tensors.items() if k != "norm.weight"}),
                    target)
    with pytest.raises(ValueError, match="only 2 layers"):
        load_eagle3(tmp_path / "ok", make_model("llama"))
    with pytest.raises(ValueError, match="does not support"):
        load_eagle3(_save(tmp_path / "ids", {**config, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, tensors),
                    target)


@pytest.mark.skipif(not (COMMITTED / "model.safetensors").is_file(), reason="the trained head is not in this checkout")
def test_committed_head_drafts_for_the_small_model(monkeypatch):
    """The trained head loads against ``models/llmplug-stdlib-small`` (bf16 on disk, at most 5 MB), and greedy
    generation with it (4 drafts every step) keeps plain greedy's tokens while accepting far more drafts than chance
    (a random head accepts next to none)."""
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, rows: self.k_max)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    size = sum(p.stat().st_size for p in COMMITTED.iterdir() if p.is_file())
    assert size <= 5e6, size
    path = COMMITTED.parent / "llmplug-stdlib-small"
    stock = AutoModelForCausalLM.from_pretrained(path)
    fast = llmplug.optimize(copy.deepcopy(stock))
    proposer = llmplug.load_eagle3(COMMITTED, fast)
    assert proposer.head.lm_head.weight.dtype == torch.float32 and proposer.aux_layers == (2, 4, 5)
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(["def read_lines(path):\n    with open(", "import os\n\n\ndef list_files(path):\n"],
              return_tensors="pt", padding=True)
    kw = dict(**enc, max_new_tokens=48, do_sample=False)
    expected = stock.generate(**kw)
    assert torch.equal(fast.generate(**kw, assistant_model=proposer, num_assistant_tokens=4), expected)
    stats = llmplug.spec_stats(fast)
    assert stats.acceptance_rate > 0.5 and stats.tokens_per_step > 2.5, stats  # the trained head: 0.9 held out
