"""Tensor parallelism: the same HF model split over the processes of a ``torchrun`` job, in place.

Every process loads the model the usual way and calls ``llmplug.optimize(model, tensor_parallel="auto")``; each then
keeps its slice of every layer (attention heads, MLP rows, vocabulary rows) and all of them run the same
``generate`` calls. Rank 0 prints; every rank gets the same tokens.

    torchrun --standalone --nproc-per-node 2 examples/tensor_parallel.py   # 2 GPUs (NCCL), or 2 CPU processes (gloo)
    python examples/tensor_parallel.py                                     # one process: nothing to split

With NCCL keep NVLink multicast off on shared hosts (``NCCL_NVLS_ENABLE=0``). Give ``init_process_group`` a
``timeout`` so that a rank that dies ends the others with an error instead of a long wait.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import transformers as tf

import llmplug


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:  # under torchrun
        rank = int(os.environ["RANK"])
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=60))
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)  # every rank builds the same random weights (a real model: from_pretrained on every rank)
    config = tf.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                              do_sample=False)  # stock HF, whole model
    llmplug.optimize(model, tensor_parallel="auto")
    got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                         do_sample=False)
    world = dist.get_world_size() if dist.is_initialized() else 1
    shard = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"ranks: {world}; rank 0 holds {shard} of {config.hidden_size} q_proj rows")
        print(f"greedy tokens equal to stock HF on the whole model: {torch.equal(got, expected)}")
    llmplug.unoptimize(model)  # every rank gets the whole weights back
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
