"""llmplug in one line: stock ``model.generate``, then ``llmplug.optimize(model)`` and the same call again.

Prints whether both outputs are equal and the wall time of each, then reverts with ``llmplug.unoptimize``.

    python examples/generate.py                          # tiny random-weight Llama, no download
    python examples/generate.py --model /path/to/hf-dir  # a local HF model directory (text prompts)

On CUDA the model runs in bf16 (outputs may differ in late tokens where bf16 logits nearly tie). On CPU it runs in
fp32 through llmplug's pure-PyTorch reference path: outputs are identical, but the speed-up is a CUDA story.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers as tf

import llmplug


def load(name: str | None, device: str,
         dtype: torch.dtype) -> tuple[torch.nn.Module, tf.PreTrainedTokenizerBase | None]:
    """``(model, tokenizer)``: a local/hub model with its tokenizer, or a tiny random Llama and no tokenizer."""
    if name is not None:
        tok = tf.AutoTokenizer.from_pretrained(name, padding_side="left")
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tf.AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval(), tok
    torch.manual_seed(0)  # the same random weights on every run
    config = tf.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: run every requested token
    model.generation_config.pad_token_id = 0
    return model, None


def timed_generate(model: torch.nn.Module, inputs: dict, max_new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy ``model.generate`` after one warm-up call (KV pool allocation, CUDA graph capture); seconds."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(2):
        sync()
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        sync()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local HF model directory (default: tiny random Llama)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tok = load(args.model, device, dtype)

    if tok is not None:
        prompts = ["The capital of France is", "Here is a short poem about the sea:\n"]
        inputs = tok(prompts, return_tensors="pt", padding=True).to(device)
    else:  # left-padded batch of token-id prompts of different lengths (pad id 0, mask 0 on the padding)
        rows = [[5, 17, 42, 99, 7], [300, 12], [8, 9, 10, 11, 12, 13, 14, 15]]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        inputs = {"input_ids": ids, "attention_mask": mask}

    stock, t_stock = timed_generate(model, inputs, args.max_new_tokens)
    model = llmplug.optimize(model)  # the one line
    fast, t_fast = timed_generate(model, inputs, args.max_new_tokens)
    llmplug.unoptimize(model)  # back to stock transformers, bit-identical

    print(f"device={device} dtype={dtype} batch={inputs['input_ids'].shape[0]} new_tokens={args.max_new_tokens}")
    print(f"outputs equal: {torch.equal(stock, fast)}")
    print(f"stock generate:   {t_stock * 1000:8.1f} ms")
    print(f"llmplug generate: {t_fast * 1000:8.1f} ms")
    width = inputs["input_ids"].shape[1]
    for row in fast[:, width:]:
        print(repr(tok.decode(row, skip_special_tokens=True)) if tok is not None else row.tolist())


if __name__ == "__main__":
    main()
