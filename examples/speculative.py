"""Speculative decoding with llmplug on the shipped models: the same greedy tokens, fewer target steps.

Runs ``models/llmplug-stdlib-small`` on a prompt that holds a near-copy of its answer (input-grounded text, where
drafts get accepted) and prints, for each way of drafting, whether the output equals plain greedy decoding and what
speculation did (acceptance, tokens a verify step):

1. ``model.generate(..., prompt_lookup_num_tokens=4)``: prompt lookup, any batch size;
2. ``model.generate(..., assistant_model=draft)``: the trained draft model ``models/llmplug-stdlib-draft``;
3. ``model.generate(..., assistant_model=llmplug.load_eagle3(...))``: the trained EAGLE-3 head;
4. ``llmplug.Engine`` with ``SpeculativeConfig(method="draft", ...)``: continuous batching with the draft model;
5. ``model.generate_batch`` with ``prompt_lookup_num_tokens`` in the generation config.

    python examples/speculative.py [--models models] [--max-new-tokens 48]

On a CPU this runs in fp32 and every output equals plain greedy decoding exactly; speculation is a GPU speed-up (a
step there is one read of the weights), so no timings are printed. ``generate`` measures what its steps cost and drafts
only what pays: on a CPU, where a step's cost grows with its tokens, that is little (prompt lookup may draft nothing);
the Engine here asks for 4 drafts every step (``adaptive=False``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import llmplug

ROOT = Path(__file__).resolve().parent.parent
SOURCE = '''def read_config(path):
    """Read a key = value file into a dict, skipping comments."""
    result = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            result[key.strip()] = value.strip()
    return result
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=ROOT / "models", help="directory of the shipped models")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    name = args.models / "llmplug-stdlib-small"
    tok = AutoTokenizer.from_pretrained(name, padding_side="left")
    model = llmplug.optimize(AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device))
    draft = AutoModelForCausalLM.from_pretrained(args.models / "llmplug-stdlib-draft", dtype=dtype).to(device)
    head = llmplug.load_eagle3(args.models / "llmplug-stdlib-small-eagle3", model)

    # the answer's near-copy first, then the start of the text to continue: drafts from the prompt get accepted
    prompts = [SOURCE.replace("result", "out") + "\n\n" + SOURCE[:120], SOURCE + "\n\n" + SOURCE[:80]]
    batch = tok(prompts, return_tensors="pt", padding=True).to(device)
    greedy = dict(**batch, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None)
    plain = model.generate(**greedy)

    for label, extra in [("prompt lookup", dict(prompt_lookup_num_tokens=4)),
                         ("draft model", dict(assistant_model=draft, num_assistant_tokens=4)),
                         ("EAGLE-3 head", dict(assistant_model=head, num_assistant_tokens=4))]:
        out = model.generate(**greedy, **extra)
        stats = llmplug.spec_stats(model)
        print(f"generate, {label}: equal to plain greedy: {torch.equal(out, plain)}; {stats.accepted} of "
              f"{stats.drafted} drafts accepted, {stats.tokens_per_step:.2f} tokens a step over {stats.steps} steps")

    ids = [tok(p)["input_ids"] for p in prompts]
    want = [row[len(batch["input_ids"][0]):].tolist() for row in plain]
    params = llmplug.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    spec = llmplug.SpeculativeConfig(method="draft", draft_model=draft, num_tokens=4, adaptive=False)
    engine = llmplug.Engine(model, llmplug.EngineConfig(speculative=spec))
    outs = engine.generate(ids, params, progress=False)
    own = outs[0].outputs[0].speculation
    print(f"Engine, draft model: equal to plain greedy: {[o.outputs[0].token_ids for o in outs] == want}; "
          f"first request's acceptance {own['acceptance_rate']:.2f}, {own['tokens_per_verified_row']:.2f} tokens a "
          f"verify step")
    engine.stop()

    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None,
                              prompt_lookup_num_tokens=4)
    results = model.generate_batch(ids, config)
    print(f"generate_batch, prompt lookup: equal to plain greedy: "
          f"{[results[f'req_{i}'].generated_tokens for i in range(len(ids))] == want}")


if __name__ == "__main__":
    main()
