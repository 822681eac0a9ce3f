"""The compile backend's decode attention over HF's static cache, by flash-decoding split count (issue 25).

Usage: python benchmarks/dense_attention_splits.py OUT.json [--lengths 384 1024 4096] [--batches 1 4]

For each static-cache length ``L`` and batch: GPU time of ``llmplug::rope_dense_decode_attention`` (RoPE, the store
at the step's position, attention with a key mask: what the backend puts in a decode step) and of the plain
``dense_decode_attention``, at each split count (0: ``choose_num_splits``'s choice), against what Inductor compiles
for HF's own code (RoPE, ``index_copy_`` into the cache, ``repeat_kv`` and SDPA with the mask as a bias; the default
backend's step). Each call is captured in a CUDA graph over rotating copies of the caches (larger than L2 together)
and replayed; every output is checked against the reference first. Shapes: the 8B layer (32 query heads over 8 kv
heads, D = 128), bf16, the new token at position ``L - 1`` (every key visible but none past it).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.bench import timing  # noqa: E402
from llmplug.ops.decode_attention import launch_decode_attention  # noqa: E402
from llmplug.ops.rope_dense_decode_attention import rope_dense_decode_attention_ref  # noqa: E402

HEADS, KV_HEADS, D = 32, 8, 128
SPLITS = (0, 1, 2, 4, 8, 16)


def inputs(bsz: int, length: int, copies: int) -> tuple[dict, list]:
    """The step's tensors and ``copies`` (k_cache, v_cache) pairs."""
    dev, dt = "cuda", torch.bfloat16
    emb = torch.rand(bsz, D // 2, device=dev) * 100
    emb = torch.cat([emb, emb], -1)
    step = {"q": torch.randn(bsz, HEADS, D, device=dev, dtype=dt), "k": torch.randn(bsz, KV_HEADS, D, device=dev,
            dtype=dt), "v": torch.randn(bsz, KV_HEADS, D, device=dev, dtype=dt), "cos": emb.cos().to(dt),
            "sin": emb.sin().to(dt), "position": torch.tensor([length - 1], device=dev),
            "mask": torch.ones(bsz, length, dtype=torch.bool, device=dev)}
    caches = [tuple(torch.randn(bsz, KV_HEADS, length, D, device=dev, dtype=dt) for _ in range(2))
              for _ in range(copies)]
    return step, caches


def fused(step: dict, splits: int, new_token: bool):
    """``fn((k_cache, v_cache))`` running the llmplug kernel at ``splits``."""
    scale = D ** -0.5
    mask = step["mask"].view(torch.uint8)

    def fn(caches):
        kc, vc = caches
        extra = dict(new_token=(step["k"], step["v"], step["cos"], step["sin"], step["position"])) if new_token else {}
        return launch_decode_attention(step["q"], kc.transpose(1, 2), vc.transpose(1, 2), None, None, scale, -1, 0.0,
                                       splits, None, None, key_mask=mask, **extra)
    return fn


def hf_step(q, k, v, cos, sin, k_cache, v_cache, position, mask):
    """HF's decode attention as the default backend compiles it: ``apply_rotary_pos_emb``, ``StaticCache.update``,
    ``repeat_kv`` and SDPA with the mask as a bias."""
    def rotate(x):
        return torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)

    c, s = cos[:, None, None], sin[:, None, None]
    q4, k4 = q[:, :, None], k[:, :, None]
    q4, k4 = q4 * c + rotate(q4) * s, k4 * c + rotate(k4) * s
    k_cache.index_copy_(2, position, k4)
    v_cache.index_copy_(2, position, v[:, :, None])
    rep = HEADS // KV_HEADS
    kr, vr = (t[:, :, None].expand(-1, -1, rep, -1, -1).reshape(t.shape[0], HEADS, t.shape[2], D)
              for t in (k_cache, v_cache))
    return F.scaled_dot_product_attention(q4, kr, vr, attn_mask=mask[:, None, None, :], scale=D ** -0.5)[:, :, 0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--lengths", type=int, nargs="+", default=[384, 1024, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    compiled = torch.compile(hf_step)
    rows = []
    for bsz in args.batches:
        for length in args.lengths:
            copies = max(2, -(-64 * 2 ** 20 // (2 * bsz * KV_HEADS * length * D * 2)))  # > L2 together
            step, caches = inputs(bsz, length, copies)
            ref = rope_dense_decode_attention_ref(*(step[n] for n in ("q", "k", "v", "cos", "sin")),
                                                  *(t.clone() for t in caches[0]), step["position"], step["mask"],
                                                  D ** -0.5)
            kv_bytes = 2 * bsz * KV_HEADS * length * D * 2
            row = {"batch": bsz, "length": length, "kv_bytes": kv_bytes, "us": {}}
            def base(c, step=step):
                return compiled(*(step[n] for n in ("q", "k", "v", "cos", "sin")), *c, step["position"], step["mask"])

            torch.testing.assert_close(base(caches[0]), ref, rtol=2e-2, atol=2e-2)
            row["us"]["inductor (HF's code)"] = 1e6 * timing.graph_time(base, caches)
            for new_token in (True, False):
                for splits in SPLITS:
                    fn = fused(step, splits, new_token)
                    if new_token:
                        torch.testing.assert_close(fn(caches[0]), ref, rtol=2e-2, atol=2e-2)
                    name = f"{'rope_dense' if new_token else 'dense'} splits={splits or 'auto'}"
                    row["us"][name] = 1e6 * timing.graph_time(fn, caches)
            rows.append(row)
            best = min(v for k, v in row["us"].items() if k.startswith("rope_dense"))
            print(f"B={bsz} L={length}: " + ", ".join(f"{k} {v:.1f}" for k, v in row["us"].items())
                  + f"; best fused {best:.1f} us = {kv_bytes / (best * 1e-6) / 1e12:.2f} TB/s", flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
