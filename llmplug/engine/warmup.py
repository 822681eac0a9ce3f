"""One-time costs a runner pays before serving rather than mid-run."""

from __future__ import annotations

import torch

from ..ops._paged_decode import MAX_SPLITS
from ..ops.prefill_attention import compile_tile_maps
from .metadata import AttentionMetadata


@torch.inference_mode()
def compile_attention_variants(runner) -> None:
    """Compile now the decode attention kernel of every split count a packed step may pick (a kernel constant: each new
    one compiled mid-serving for ~0.6 s on an H100, BENCHMARKS.md "Triton compiles while serving"): a 3-token step a
    power-of-two count and page-table width (Triton specialises the table's row stride on divisibility by 16), of a
    decode row and a 2-token prefill row that read page 0 and store nothing; and every variant of prefill attention's
    tile map. CUDA only."""
    if runner.device.type != "cuda":
        return
    dev = runner.device
    compile_tile_maps(runner.head_dim, runner.num_heads // runner.num_kv_heads, runner.dtype, dev)
    context = torch.tensor([1, 0], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=dev)
    slots = torch.full((3,), -1, dtype=torch.long, device=dev)
    positions = torch.tensor([1, 0, 1], device=dev)
    for width in (17, 32):
        tables = torch.zeros(2, width, dtype=torch.int32, device=dev)
        for splits in (1 << i for i in range(MAX_SPLITS.bit_length())):
            meta = AttentionMetadata(query_len=0, slot_mapping=slots, block_tables=tables, cu_seqlens_q=cu,
                                     context_lens=context, max_seqlen_q=2, seq_lens=context[:1] + 1, num_decodes=1,
                                     num_splits=splits)
            runner._forward(torch.zeros(3, dtype=torch.long, device=dev), positions, meta, cu[1:] - 1)
