"""``transformers.pipeline`` keeps working after ``llmplug.optimize``: a chat turn, stock and then optimized.

    python examples/pipeline_chat.py                          # tiny random Llama + in-memory tokenizer, no download
    python examples/pipeline_chat.py --model models/llmplug-stdlib-small  # the trained model in this repository
    python examples/pipeline_chat.py --model /path/to/hf-dir  # a local chat model (one without a chat template
                                                              # gets a minimal one)

The pipeline holds the model object, and ``optimize`` works in place, so one pipeline serves both runs.
"""

from __future__ import annotations

import argparse
import string

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import llmplug

MINIMAL_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def char_tokenizer() -> tf.PreTrainedTokenizerFast:
    """A character-level fast tokenizer built in memory, with a minimal chat template."""
    chars = string.ascii_letters + string.digits + string.punctuation + " \n"
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *chars])}  # anything else maps to <pad>
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                      padding_side="left")
    fast.chat_template = MINIMAL_TEMPLATE
    return fast


def load(name: str | None, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, tf.PreTrainedTokenizerBase]:
    """A local model and its tokenizer, or a tiny random-weight Llama sized to the in-memory tokenizer."""
    if name is not None:
        tok = tf.AutoTokenizer.from_pretrained(name, padding_side="left")
        if tok.chat_template is None:  # a base model, like the trained one in models/: chat needs some template
            print(f"({name} has no chat template: using a minimal one)")
            tok.chat_template = MINIMAL_TEMPLATE
        return tf.AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval(), tok
    torch.manual_seed(0)  # the same random weights on every run
    tok = char_tokenizer()
    config = tf.LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id)
    with torch.device(device):
        return tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local HF chat model directory (default: tiny random Llama)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load(args.model, device, torch.bfloat16 if device == "cuda" else torch.float32)

    pipe = tf.pipeline("text-generation", model=model, tokenizer=tok)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Name three colours of the rainbow."}]
    # With the default random weights the reply is gibberish; the point is that stock and llmplug agree.
    stock = pipe(messages, max_new_tokens=args.max_new_tokens, do_sample=False)
    llmplug.optimize(model)
    fast = pipe(messages, max_new_tokens=args.max_new_tokens, do_sample=False)
    llmplug.unoptimize(model)

    reply = fast[0]["generated_text"][-1]  # the conversation with the assistant's turn appended
    print(f"assistant ({reply['role']}): {reply['content']!r}")
    print(f"same reply as stock pipeline: {stock == fast}")


if __name__ == "__main__":
    main()
