r"""Train an EAGLE-3 draft head for ``models/llmplug-stdlib-small`` and save it in the reference format.

The head is :class:`llmplug.spec.eagle3.Eagle3Head`: one Llama layer (the target's width and heads) over the token
embedding and ``fc`` of the target's inputs of layers ``(2, L // 2, L - 3)``. Its output layer covers the
``--draft-vocab`` most frequent tokens of the training text (``d2t`` / ``t2d`` map them). The target stays frozen. Its
input embedding is shared, so the head does not store one. ``lm_head`` and the final norm start as the target's rows.

Data: the same standard-library ``.py`` files, split, and ``<|bos|> ... <|eos|>`` packing as
``scripts/train_small_models.py`` (its functions are imported), encoded with the target's own tokenizer. The soft
targets are the target's next-token distributions, restricted to the draft vocabulary. Positions whose target argmax
lies outside it are left out, as in the reference trainer.

Training-time test (EAGLE-3): every batch unrolls ``--ttt-steps`` draft steps. Step ``j`` at index ``t`` reads the
token at ``t + 1 + j`` and, for ``j > 0``, the head's own output of step ``j - 1`` at ``t``, at RoPE position
``t + j``. It predicts the target's distribution at ``t + 1 + j``. Its query attends to step 0's keys at indices
``<= t`` (causally) and to the keys of steps ``1..j`` at ``t`` alone. This is what a draft at depth ``j`` sees after
the verified position ``t``. Losses are weighted ``--loss-decay ** j``. Training uses AdamW (betas 0.9/0.95, weight
decay 0.1 on matrices), warm-up then cosine to 10%, gradient clipping at 1.0, and bf16 autocast on CUDA. It is
seeded, and ``--time-budget-s`` stops it as in the base script.

Held-out evaluation: prompts of ``--eval-prompt-len`` tokens from the held-out files, each continued greedily by the
target for ``--eval-new-tokens`` tokens (fp32). The head unrolls ``--eval-depth`` drafts after each generated
position. The report gives the per-position acceptance: the share of draft ``j`` that equals the target's token when
drafts ``0..j-1`` did. It also gives the expected tokens a greedy verify step of ``k`` drafts emits (``1 + sum of
the chain rates``), and the teacher-forced accuracy. Then the saved head drives ``model.generate(...,
assistant_model=llmplug.load_eagle3(out, model))`` on ``--e2e-prompts`` of those prompts. That run checks token
identity with plain greedy and reports ``llmplug.spec_stats`` (the drafts a step are llmplug's adaptive choice for
the device, at most ``--e2e-k``).

Output ``--out``: ``config.json``, ``model.safetensors`` (bf16 weights, int64 ``d2t``, bool ``t2d``) and
``train_report.json``. The directory must stay within ``--max-mb`` (5 MB) or the script fails.

GPU run (one H100: ~3 minutes of training plus under a minute of encoding and evaluation). Encode the corpus where
the target's training text lives, carry the ids, and bring ``$OUT/llmplug-stdlib-small-eagle3`` back to
``models/``::

    python scripts/train_eagle3.py --save-ids models/.cache/eagle3-ids.npz        # CPU, ~30 s
    python scripts/train_eagle3.py --ids models/.cache/eagle3-ids.npz --device cuda --time-budget-s 180 \
        --out $OUT/llmplug-stdlib-small-eagle3

CPU smoke run: ``python scripts/train_eagle3.py --out /tmp/e3 --device cpu --max-files 30 --steps 3 --batch-size 2
--seq-len 64 --ttt-steps 2 --eval-prompts 2 --eval-new-tokens 16 --e2e-prompts 2``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "scripts"), str(REPO)]

from train_small_models import (  # noqa: E402
    autocast,
    batches,
    dir_bytes,
    encode_docs,
    lr_at,
    split_files,
    stdlib_files,
)

import llmplug  # noqa: E402
from llmplug.spec.eagle3 import Eagle3Head, default_aux_layers  # noqa: E402

HEAD_NAME = "llmplug-stdlib-small-eagle3"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv`` defaults to ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, default=REPO / "models" / "llmplug-stdlib-small")
    p.add_argument("--out", type=Path, default=REPO / "models" / HEAD_NAME)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--corpus", type=Path, default=None, help="a copied stdlib directory instead of this interpreter's")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N sorted files (tests)")
    p.add_argument("--ids", type=Path, default=None, help="token ids written by --save-ids, instead of a corpus")
    p.add_argument("--save-ids", type=Path, default=None, help="encode the corpus into this .npz and stop")
    p.add_argument("--steps", type=int, default=20000, help="optimizer steps (upper bound)")
    p.add_argument("--time-budget-s", type=float, default=None, help="stop training after this long")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512, help="tokens a training window")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--ttt-steps", type=int, default=7, help="draft steps unrolled a batch (training-time test)")
    p.add_argument("--loss-decay", type=float, default=0.8, help="weight of step j's loss: decay ** j")
    p.add_argument("--draft-vocab", type=int, default=4096, help="tokens the head can propose (most frequent)")
    p.add_argument("--intermediate", type=int, default=None, help="head MLP width (default: the target's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-mb", type=float, default=5.0, help="fail when the output directory exceeds this (1e6 B)")
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--eval-prompt-len", type=int, default=64)
    p.add_argument("--eval-new-tokens", type=int, default=128)
    p.add_argument("--eval-depth", type=int, default=8, help="drafts unrolled after each evaluated position")
    p.add_argument("--e2e-prompts", type=int, default=16, help="held-out prompts run through generate (0: none)")
    p.add_argument("--e2e-k", type=int, default=5, help="num_assistant_tokens of that run")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------- data
def encode_corpus(args: argparse.Namespace, tok: Tokenizer) -> tuple[np.ndarray, np.ndarray, dict]:
    """``(train ids, val ids, info)``: from ``--ids``, or the stdlib files split and packed as the base script does."""
    if args.ids is not None:
        with np.load(args.ids, allow_pickle=False) as z:
            return z["train"], z["val"], json.loads(str(z["info"]))
    files = stdlib_files(args.max_files, args.corpus)
    train, val = split_files(files)
    info = {"corpus": str(args.corpus or "this interpreter's stdlib"), "python": platform.python_version(),
            "train_files": len(train), "val_files": len(val)}
    return encode_docs(tok, [t for _, t in train]), encode_docs(tok, [t for _, t in val]), info


def draft_vocabulary(train: np.ndarray, vocab: int, size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent ids of ``train`` (sorted) and the share of training tokens they cover."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab)
    ids = np.sort(np.argsort(-counts, kind="stable")[:size])
    return torch.from_numpy(ids), float(counts[ids].sum() / counts.sum())


# ----------------------------------------------------------------------------------------------------------- head
def head_config(target_config, args: argparse.Namespace) -> dict:
    """The head's ``config.json`` (the reference format's fields)."""
    t = target_config
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": t.hidden_size, "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_key_value_heads, "head_dim": t.head_dim,
            "intermediate_size": args.intermediate or t.intermediate_size, "hidden_act": t.hidden_act,
            "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_parameters["rope_theta"],
            "rope_parameters": dict(t.rope_parameters), "max_position_embeddings": t.max_position_embeddings,
            "vocab_size": t.vocab_size, "draft_vocab_size": args.draft_vocab, "tie_word_embeddings": False,
            "bos_token_id": t.bos_token_id, "eos_token_id": t.eos_token_id, "pad_token_id": t.pad_token_id,
            "dtype": "bfloat16"}


def new_head(config: dict, target, draft_ids: torch.Tensor) -> Eagle3Head:
    """A fresh head: linears ~ N(0, 0.02), norms 1, ``lm_head`` and ``norm`` the target's (draft rows)."""
    head = Eagle3Head(LlamaConfig(**config))
    for p in head.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids])
        head.norm.weight.copy_(target.model.norm.weight)
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    return head


@torch.no_grad()
def target_pass(target, window: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``window (B, S)`` -> ``(aux (B, S, 3H), logits (B, S, V))`` of the frozen target."""
    with autocast(window.device):
        out = target(input_ids=window, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i] for i in layers], dim=-1), out.logits


def unroll(head: Eagle3Head, embed, window: torch.Tensor, aux: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """The training-time test: ``depth`` draft steps over every index ``t < S - 1`` of ``window (B, S)`` -> per step
    the draft logits ``(B, S - 1, Vd)`` (step ``j`` at ``t`` predicts token ``t + 2 + j``)."""
    rows, span = window.shape[0], window.shape[1] - 1
    group = head.config.num_attention_heads // head.config.num_key_value_heads
    index = torch.arange(span, device=window.device)
    causal = index[None, :] <= index[:, None]
    feature = head.fc(aux[:, :span])
    keys, values, out = [], [], []
    for j in range(depth):
        tokens = F.pad(window[:, 1 + j:], (0, j))  # the token after each index, j further on (0 past the end)
        q, k, v = head.attention_inputs(embed(tokens).to(feature.dtype), feature, (index + j).expand(rows, -1))
        keys.append(k.repeat_interleave(group, dim=1))
        values.append(v.repeat_interleave(group, dim=1))
        scale = q.shape[-1] ** -0.5
        first = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
        own = [(q * k_i).sum(-1, keepdim=True) * scale for k_i in keys[1:]]  # steps 1..j at the same index
        weights = torch.softmax(torch.cat([first, *own], dim=-1).float(), dim=-1).to(q.dtype)
        attended = weights[..., :span] @ values[0]
        for i, v_i in enumerate(values[1:]):
            attended = attended + weights[..., span + i, None] * v_i
        feature = head.attention_output(feature, attended)
        out.append(head.logits(feature))
    return out


def ttt_loss(head, embed, window, aux, logits, args) -> tuple[torch.Tensor, list[float]]:
    """Weighted soft cross-entropy of the unrolled steps against the target -> ``(loss, per-step top-1 accuracy)``."""
    span, draft = window.shape[1] - 1, head.t2d.nonzero().squeeze(1)
    with torch.no_grad():
        probs = torch.softmax(logits[:, 1:, draft].float(), dim=-1)  # (B, S - 1, Vd): at index t, the target's at t+1
        known = head.t2d[logits[:, 1:].argmax(-1)]
    loss, accuracy = 0.0, []
    with autocast(window.device):
        steps = unroll(head, embed, window, aux, args.ttt_steps)
    for j, step in enumerate(steps):
        mask = known[:, j:].float()
        logp = torch.log_softmax(step[:, :span - j].float(), dim=-1)
        loss = loss + args.loss_decay ** j * -((probs[:, j:] * logp).sum(-1) * mask).sum() / mask.sum().clamp(min=1)
        hits = (step[:, :span - j].argmax(-1) == probs[:, j:].argmax(-1)).float()
        accuracy.append(float((hits * mask).sum() / mask.sum().clamp(min=1)))
    return loss, accuracy


def train(head, target, embed, data: torch.Tensor, layers, args) -> dict:
    """Train ``head`` in place on the packed stream ``data (N,)``; step, time and loss figures."""
    decay = [p for p in head.parameters() if p.ndim >= 2]
    rest = [p for p in head.parameters() if p.ndim < 2]
    fused = data.device.type == "cuda"
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=fused)
    stream = batches(data, args.seq_len, args.batch_size, args.seed)
    warmup = min(args.warmup_steps, args.steps // 5)
    budget = args.time_budget_s
    head.train()
    step, stopped, log = 0, "steps", []
    t0 = time.perf_counter()
    while step < args.steps:
        elapsed = time.perf_counter() - t0
        if budget is not None and elapsed >= budget:
            stopped = "time_budget"
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, max(step / args.steps, elapsed / budget if budget else 0.0), args.lr, warmup)
        window = next(stream)
        aux, logits = target_pass(target, window, layers)
        loss, accuracy = ttt_loss(head, embed, window, aux, logits, args)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 50 == 0 or step == args.steps:
            log.append({"step": step, "s": round(time.perf_counter() - t0, 1), "loss": round(loss.item(), 4),
                        "accuracy": [round(a, 3) for a in accuracy]})
            print(f"step {step}: {log[-1]}", flush=True)
    if fused:
        torch.cuda.synchronize()
    head.eval()
    return {"steps": step, "stopped_by": stopped, "wall_time_s": round(time.perf_counter() - t0, 2),
            "tokens_seen": step * args.batch_size * args.seq_len, "log": log}


# ----------------------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def greedy_continuations(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``prompts (N, P)`` each continued by ``new_tokens`` greedy tokens of the target (fp32, a full forward a token;
    eos does not stop it) -> ``(N, P + new_tokens)``."""
    seq = prompts
    for _ in range(new_tokens):
        logits = target(input_ids=seq, use_cache=False, logits_to_keep=1).logits
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


@torch.no_grad()
def evaluate(head, target, embed, sequences: torch.Tensor, prompt_len: int, depth: int, layers) -> dict:
    """Per-position acceptance of the head's greedy drafts against the target's greedy ``sequences (N, L)`` after
    every generated position (fp32)."""
    out = target(input_ids=sequences, output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
    steps = unroll(head, embed, sequences, aux, depth)
    length = sequences.shape[1]
    first, last = prompt_len - 1, length - 2 - depth  # indices t whose drafts 0..depth-1 all have a true token
    correct = torch.stack([head.to_target(s[:, first:last + 1].argmax(-1)) == sequences[:, first + 2 + j:last + 3 + j]
                           for j, s in enumerate(steps)])  # (depth, N, positions)
    chain = correct.float().cumprod(0).mean((1, 2)).tolist()
    conditional = [chain[0]] + [c / p if p else 0.0 for p, c in zip(chain, chain[1:])]
    return {"positions": int(correct[0].numel()), "acceptance_per_position": [round(a, 4) for a in conditional],
            "chain": [round(c, 4) for c in chain],
            "expected_tokens_per_step": {k: round(1 + sum(chain[:k]), 4) for k in range(1, depth + 1)},
            "teacher_forced_accuracy": [round(float(c.float().mean()), 4) for c in correct]}


def generate_check(out_dir: Path, args, prompts: torch.Tensor, tok) -> dict:
    """Greedy ``generate`` of the saved head through llmplug (target loaded fresh from ``--target``, fp32) against
    plain greedy: identity and the call's speculation statistics."""
    target = AutoModelForCausalLM.from_pretrained(args.target).to(prompts.device).eval()
    llmplug.optimize(target)
    proposer = llmplug.load_eagle3(out_dir, target)
    kw = dict(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.eval_new_tokens,
              do_sample=False, pad_token_id=tok.pad_token_id)
    t0 = time.perf_counter()
    plain = target.generate(**kw)
    t1 = time.perf_counter()
    spec = target.generate(**kw, assistant_model=proposer, num_assistant_tokens=args.e2e_k)
    t2 = time.perf_counter()
    stats = llmplug.spec_stats(target)
    return {"prompts": len(prompts), "num_assistant_tokens": args.e2e_k, "identical": bool(torch.equal(plain, spec)),
            "acceptance_rate": round(stats.acceptance_rate, 4), "tokens_per_step": round(stats.tokens_per_step, 4),
            "drafted": stats.drafted, "verify_steps": stats.steps, "plain_s": round(t1 - t0, 3),
            "speculative_s": round(t2 - t1, 3), "sample": tok.decode(spec[0, prompts.shape[1]:])}


# ----------------------------------------------------------------------------------------------------------- main
def save(head: Eagle3Head, config: dict, out: Path) -> None:
    """``config.json`` and ``model.safetensors`` (floats in bf16) into a fresh ``out``."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).detach().cpu().contiguous()
               for k, v in head.state_dict().items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict | None:
    """Encode, train, save, evaluate; return the report (also written to ``<out>/train_report.json``)."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    raw_tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    train_np, val_np, data_info = encode_corpus(args, raw_tok)
    if args.save_ids is not None:
        args.save_ids.parent.mkdir(parents=True, exist_ok=True)
        (args.save_ids.parent / ".gitignore").write_text("*\n")
        np.savez_compressed(args.save_ids, train=train_np, val=val_np, info=np.array(json.dumps(data_info)))
        print(f"wrote {args.save_ids}: {train_np.size:,} / {val_np.size:,} tokens", flush=True)
        return None
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    target.requires_grad_(False)
    layers = default_aux_layers(target.config.num_hidden_layers)
    embed = target.get_input_embeddings()
    draft_ids, coverage = draft_vocabulary(train_np, target.config.vocab_size, args.draft_vocab)
    config = head_config(target.config, args)
    head = new_head(config, target, draft_ids).to(device)
    n_params = sum(p.numel() for p in head.parameters())
    print(f"data {data_info}: {train_np.size:,} / {val_np.size:,} tokens; draft vocabulary {args.draft_vocab} covers "
          f"{coverage:.1%} of training tokens; head {n_params:,} parameters; aux layers {layers}", flush=True)
    stats = train(head, target, embed, torch.from_numpy(train_np.astype(np.int64)).to(device), layers, args)
    save(head, config, args.out)
    report = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "data": data_info, "train_tokens": int(train_np.size), "val_tokens": int(val_np.size),
        "aux_layers": list(layers), "draft_vocab": args.draft_vocab, "draft_vocab_coverage": round(coverage, 4),
        "params": n_params, "training": stats, "held_out": None, "generate": None,
    }

    def write() -> None:  # after each stage, so a failing evaluation leaves what came before
        report["total_wall_time_s"] = round(time.perf_counter() - t_start, 2)
        (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
        size = dir_bytes(args.out)
        if size > args.max_mb * 1e6:
            raise RuntimeError(f"{args.out} takes {size / 1e6:.2f} MB > the {args.max_mb} MB limit")
        print(f"wrote {args.out} ({size / 1e6:.2f} MB)", flush=True)

    write()
    val = torch.from_numpy(val_np.astype(np.int64))
    stride = max(1, (val.numel() - args.eval_prompt_len) // args.eval_prompts)
    prompts = torch.stack([val[i * stride:i * stride + args.eval_prompt_len] for i in range(args.eval_prompts)])
    prompts = prompts.to(device)
    sequences = greedy_continuations(target, prompts, args.eval_new_tokens)
    report["held_out"] = evaluate(head, target, embed, sequences, args.eval_prompt_len, args.eval_depth, layers)
    print(f"held-out: {report['held_out']}", flush=True)
    write()
    if args.e2e_prompts:
        report["generate"] = generate_check(args.out, args, prompts[:args.e2e_prompts], tok)
        print(f"generate: {report['generate']}", flush=True)
        write()
    return report

if __name__ == "__main__":
    main()
