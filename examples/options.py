"""llmplug's options and the generate features that ride on it: config, sampling, scores, streamers, fallback.

    python examples/options.py                          # tiny random-weight Llama, no download
    python examples/options.py --model /path/to/hf-dir  # a local HF model directory (its tokenizer streams text)
"""

from __future__ import annotations

import argparse
import warnings

import torch
import transformers as tf
from transformers.generation.streamers import BaseStreamer

import llmplug


class IdStreamer(BaseStreamer):
    """Prints token ids as they arrive (the first ``put`` is the prompt); used when there is no tokenizer."""

    def put(self, value: torch.Tensor) -> None:
        print(value.tolist(), end=" ", flush=True)

    def end(self) -> None:
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local HF model directory (default: tiny random Llama)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if args.model is not None:
        tok = tf.AutoTokenizer.from_pretrained(args.model, padding_side="left")
        model = tf.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
        inputs = tok(["Once upon a time"], return_tensors="pt").to(device)
    else:
        tok, config = None, tf.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        with torch.device(device):
            model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        model.generation_config.eos_token_id = None  # random weights: run every requested token
        inputs = {"input_ids": torch.tensor([[1, 15, 27, 300, 8]], device=device)}

    # Options: an OptimizeConfig (validated on construction) plus keyword overrides of single fields.
    config = llmplug.OptimizeConfig(kv_block_size=32, kv_num_blocks=64, max_prefill_tokens=1024, cuda_graphs=cuda)
    llmplug.optimize(model, config, kv_num_blocks=128)  # overrides win: a pool of 128 pages of 32 tokens
    llmplug.unoptimize(model)
    model = llmplug.optimize(model, kv_block_size=16, max_prefill_tokens=512)  # keywords alone work too
    print(f"optimized: {llmplug.is_optimized(model)}")
    try:  # bad values (and unknown keys) raise, naming what is allowed
        llmplug.OptimizeConfig(kv_block_size=12)
    except ValueError as e:
        print(f"ValueError: {e}")

    # Sampling: the same seed gives the same tokens.
    sample = dict(do_sample=True, temperature=0.8, top_p=0.9, max_new_tokens=12)
    torch.manual_seed(0)
    first = model.generate(**inputs, **sample)
    torch.manual_seed(0)
    runs = (first, model.generate(**inputs, **sample))
    print(f"sampled twice with seed 0, equal: {torch.equal(*runs)}")

    # Per-step scores (processed logits), as with stock transformers.
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True)
    print(f"sequences {tuple(out.sequences.shape)}; {len(out.scores)} score tensors of {tuple(out.scores[0].shape)}")

    # Streaming: tokens are handed to the streamer as each decode step finishes.
    streamer = tf.TextStreamer(tok, skip_prompt=True) if tok is not None else IdStreamer()
    print("streamed: ", end="", flush=True)
    model.generate(**inputs, max_new_tokens=8, do_sample=False, streamer=streamer)

    # Unsupported options (beam search here) run stock transformers generate, with a one-time warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(**inputs, max_new_tokens=4, num_beams=2, do_sample=False)
        model.generate(**inputs, max_new_tokens=4, num_beams=2, do_sample=False)  # no second warning
    print(*(f"fallback warning: {w.message}" for w in caught if "llmplug" in str(w.message)), sep="\n")
    llmplug.unoptimize(model)


if __name__ == "__main__":
    main()
