"""Pieces shared by the matmul ops (``w8_linear``, ``w4_linear``, and the GEMV rows and epilogue of ``gemv``): cheap
integer decoding, GEMV rows and epilogue (plain or gated), split-K (a partial-sum workspace and its reduction kernel).

Integer decoding: ``int -> float`` conversion instructions run at a quarter of the FMA rate on Hopper, which caps
a GEMV reading one int8 per multiply well below the memory bandwidth. Instead a small unsigned integer ``u < 2^23``
is OR-ed into the mantissa of ``2^23`` and ``2^23`` subtracted back (bitwise OR plus one FADD, full rate, exact).
"""

from __future__ import annotations

import torch

from ._triton import INTERPRET, maybe_wrap, next_pow2, pdl_options, round_rne, rounded, tl, triton, wait_inputs
from .act_mul import store_gated

MAGIC = 8388608.0  # 2^23: float(bits(2^23) | u) == 2^23 + u for u < 2^23

if triton is not None:

    @triton.jit
    def u32_to_f32(u):
        """Exact float of a uint32 tensor with values below 2^23."""
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def field_f32(w, SHIFT: tl.constexpr, BITS: tl.constexpr, OFFSET_LOG2: tl.constexpr):
        """``2^OFFSET_LOG2 +`` the ``BITS``-bit unsigned field at bit ``SHIFT`` of each int32 word, exactly, as float32:
        the field moved to the mantissa bits of ``2^OFFSET_LOG2`` where a unit step is 1.0 (one shift, one LOP3).

        Nibbles: ``(BITS, OFFSET_LOG2) = (4, 7)`` gives 128 + q; bytes: ``(8, 8)`` gives 256 + u. A small offset keeps
        the later subtraction of ``offset * sum(x)`` from costing precision."""
        TO: tl.constexpr = 23 - OFFSET_LOG2
        if SHIFT < TO:
            w = w << (TO - SHIFT)
        elif SHIFT > TO:
            w = w >> (SHIFT - TO)
        return ((w & (((1 << BITS) - 1) << TO)) | ((127 + OFFSET_LOG2) << 23)).to(tl.float32, bitcast=True)

    @triton.jit
    def int64_halves(v):
        """``(low, high)`` int32 halves of each int64 (four bf16 values read at once: two a half, the lower-indexed
        value in the low 16 bits)."""
        return v.to(tl.int32), (v >> 32).to(tl.int32)

    @triton.jit
    def w8_to_f32(w):
        """int8 (two's complement) or float8e4nv weights -> float32."""
        if w.dtype == tl.int8:
            u = (w.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint32)  # q + 128 in [1, 255]
            return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0  # 2^23 + 128
        else:
            return w.to(tl.float32)

    @triton.jit
    def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """``(pid_m, pid_n)`` of this program in grouped launch order: GROUP_M row tiles share each weight column
        tile while it is in L2."""
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
        size_m = min(tiles_m - first_m, GROUP_M)
        return first_m + (pid % (GROUP_M * tiles_n)) % size_m, (pid % (GROUP_M * tiles_n)) // size_m

    @triton.jit
    def gemv_rows(pid, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
        """Weight rows GEMV program ``pid`` computes: ``BLOCK_N`` consecutive rows; with ``GATED`` (a fused gate/up
        weight, gate rows first) ``BLOCK_N / 2`` gate rows from ``pid * BLOCK_N / 2`` and their up rows ``N / 2``
        further. Returns ``(rows, mask)``."""
        if GATED != "":
            HALF: tl.constexpr = BLOCK_N // 2
            r = tl.arange(0, BLOCK_N)
            inner = pid * HALF + r % HALF
            return tl.where(r < HALF, inner, inner + N // 2), inner < N // 2
        else:
            rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            return rows, rows < N

    @triton.jit
    def store_rows(out_ptr, y, pid, rows, row_mask, N, b_ptr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                   BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
        """GEMV epilogue over :func:`gemv_rows`' rows: ``out[rows] = y (+ bias[rows])`` rounded to the output dtype,
        or with ``GATED`` ``act(gate) * up`` into ``out[pid * BLOCK_N / 2 ..]`` (:func:`store_gated`)."""
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        if GATED != "":
            store_gated(out_ptr, y, pid * (BLOCK_N // 2), N // 2, BLOCK_N, GATED, INTERPRETED)
        else:
            if INTERPRETED:
                y = round_rne(y, out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)

    @triton.jit
    def deferred_rstd(part_ptr, n_parts, K, eps, BLOCK_P: tl.constexpr, P_CHUNKS: tl.constexpr):
        """``rsqrt(sum(parts) / K + eps)``: the RMSNorm factor of a length-``K`` input whose squares the GEMV that
        wrote it summed into ``n_parts <= P_CHUNKS * BLOCK_P`` partial sums (:func:`store_add_norm`), read
        ``BLOCK_P`` at a time (unrolled: a runtime loop here cost the 8B int8 step 0.018 ms) and added in a fixed
        order."""
        offs = tl.arange(0, BLOCK_P)
        acc = tl.load(part_ptr + offs, mask=offs < n_parts, other=0.0)
        for c in tl.static_range(1, P_CHUNKS):
            acc += tl.load(part_ptr + c * BLOCK_P + offs, mask=(c * BLOCK_P + offs) < n_parts, other=0.0)
        return tl.rsqrt(tl.sum(acc, axis=0) / K + tl.cast(eps, tl.float32))

    @triton.jit
    def store_add_norm(out_ptr, y, pid, rows, row_mask, b_ptr, res_ptr, res_out_ptr, nw_ptr, part_ptr, offset,
                       HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr):
        """GEMV epilogue that starts the next RMSNorm: ``s = y (+ bias) + residual``, rounded where an HF forward
        rounds (the projection's output, then the sum), into ``res_out[rows]``; ``(norm_weight + offset) * s``
        rounded into ``out[rows]``; the program's ``sum(s^2)`` into ``part[pid]``. The next GEMV scales its sums by
        :func:`deferred_rstd`: ``rstd * (W @ out)`` stands for ``W @ rms_norm(s)``, with the weight multiplied before
        the normalisation instead of after (one rounding of the input in either order)."""
        dt = res_out_ptr.dtype.element_ty
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        res = tl.load(res_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        s = rounded(rounded(y, dt, INTERPRETED) + res, dt, INTERPRETED)
        tl.store(res_out_ptr + rows, s.to(dt), mask=row_mask)
        w = tl.load(nw_ptr + rows, mask=row_mask, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32)
        tl.store(out_ptr + rows, rounded(s * w, dt, INTERPRETED).to(dt), mask=row_mask)
        tl.store(part_ptr + pid, tl.sum(tl.where(row_mask, s * s, 0.0), axis=0))

    @triton.jit
    def gemv_epilogue(out_ptr, y, pid, rows, row_mask, N, K, b_ptr, res_ptr, res_out_ptr, nw_ptr, part_ptr, n_parts,
                      eps, offset, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                      NORM: tl.constexpr, BLOCK_P: tl.constexpr, P_CHUNKS: tl.constexpr, INTERPRETED: tl.constexpr):
        """A quantized GEMV's epilogue (:func:`norm_launch_args`): ``NORM`` 0 :func:`store_rows`; 1
        :func:`store_add_norm`; 2 :func:`store_rows` of ``y`` scaled by :func:`deferred_rstd` of the input."""
        if NORM == 2:
            y = y * deferred_rstd(part_ptr, n_parts, K, eps, BLOCK_P, P_CHUNKS)
        if NORM == 1:
            store_add_norm(out_ptr, y, pid, rows, row_mask, b_ptr, res_ptr, res_out_ptr, nw_ptr, part_ptr, offset,
                           HAS_BIAS, INTERPRETED)
        else:
            store_rows(out_ptr, y, pid, rows, row_mask, N, b_ptr, HAS_BIAS, GATED, BLOCK_N, INTERPRETED)

    @triton.jit
    def store_tile(out_ptr, y, offs_m, offs_n, M, N, stride_om, b_ptr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                   INTERPRETED: tl.constexpr):
        """GEMM epilogue: the fp32 partial sum of split ``program_id(1)`` into the ``(SPLIT_K, M, N)`` workspace,
        or, unsplit, ``y (+ bias)`` rounded into ``out (M, N)``."""
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        if SPLIT_K > 1:  # split_k_reduce adds the partial sums up with the bias
            ws = out_ptr + tl.program_id(1).to(tl.int64) * M * N
            tl.store(ws + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], y, mask=mask)
        else:
            if HAS_BIAS:
                y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            if INTERPRETED:
                y = round_rne(y, out_ptr.dtype.element_ty)
            out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _split_k_reduce_kernel(ws_ptr, b_ptr, out_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                               BLOCK: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        wait_inputs(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLIT_K):
            acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        if INTERPRETED:
            acc = round_rne(acc, out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


NORM_PARTS_BLOCK = 1024  # partial sums of a deferred RMSNorm the next GEMV reads at a time (8B o / down leave 1,024)


def norm_launch_args(norm: tuple | None, n_programs: int) -> dict:
    """Keywords for a GEMV kernel ending in :func:`gemv_epilogue`.

    ``norm``: None (a plain GEMV); ``("in", parts, eps)``: the input is ``(norm_weight + offset) * s`` as
    :func:`store_add_norm` left it, ``parts`` its partial sums of squares; ``("out", residual, norm_weight, offset,
    residual_out, parts)``: start the next RMSNorm (``parts`` takes one fp32 sum a program, ``n_programs``).
    """
    if norm is None:
        return dict(res_ptr=None, nw_ptr=None, res_out_ptr=None, part_ptr=None, n_parts=0, eps=0.0, norm_offset=0.0,
                    NORM=0, BLOCK_P=1, P_CHUNKS=1)
    if norm[0] == "in":
        _, parts, eps = norm
        block = min(next_pow2(parts.numel()), NORM_PARTS_BLOCK)
        return dict(res_ptr=None, nw_ptr=None, res_out_ptr=None, part_ptr=parts, n_parts=parts.numel(), eps=eps,
                    norm_offset=0.0, NORM=2, BLOCK_P=block, P_CHUNKS=triton.cdiv(parts.numel(), block))
    _, residual, norm_weight, offset, residual_out, parts = norm
    assert parts.numel() == n_programs, "one partial sum a program"
    return dict(res_ptr=residual, nw_ptr=norm_weight, res_out_ptr=residual_out, part_ptr=parts, n_parts=n_programs,
                eps=0.0, norm_offset=offset, NORM=1, BLOCK_P=1, P_CHUNKS=1)


def check_rstd_parts(parts: torch.Tensor, x: torch.Tensor, block_m: int) -> None:
    """Validate a deferred RMSNorm's partial sums for a GEMV over ``x`` (``block_m``: the chosen kernel's rows)."""
    if x.shape[0] != 1 or block_m != 1:
        raise ValueError(f"rstd_parts needs one token on the GEMV, got x of shape {tuple(x.shape)} "
                         f"({'the GEMV' if block_m == 1 else 'the GEMM'} for this input and weight)")
    if parts.dim() != 1 or parts.dtype != torch.float32 or parts.numel() == 0:
        raise ValueError(f"rstd_parts must be 1-D float32 with at least one sum, got {tuple(parts.shape)} "
                         f"{parts.dtype}")


def check_add_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, n: int, k: int) -> None:
    """Validate a GEMV that ends the residual add and starts the next RMSNorm (``w8_linear_add_norm``,
    ``w4_linear_add_norm``) over a ``(N, K)`` weight."""
    if x.dim() != 2 or x.shape != (1, k):
        raise ValueError(f"x must be (1, {k}) (one token), got {tuple(x.shape)}")
    if residual.shape != (1, n) or residual.dtype != x.dtype or norm_weight.shape != (n,):
        raise ValueError(f"residual must be (1, {n}) {x.dtype} and norm_weight ({n},), got {tuple(residual.shape)} "
                         f"{residual.dtype} and {tuple(norm_weight.shape)}")


def add_norm_outputs(x: torch.Tensor, residual: torch.Tensor, n: int,
                     block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``(out (1, N), residual_out, parts)`` for a GEMV of ``block_n`` rows a program ending in
    :func:`store_add_norm` (one fp32 partial sum a program)."""
    return (x.new_empty((1, n)), residual.new_empty(residual.shape),
            x.new_empty((-(-n // block_n),), dtype=torch.float32))


def deferred_rstd_ref(parts: torch.Tensor, k: int, eps: float) -> torch.Tensor:
    """Reference of :func:`deferred_rstd`: a 0-d fp32 tensor."""
    return torch.rsqrt(parts.float().sum() / k + eps)


def add_norm_ref(y: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, offset: float,
                 n_parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of :func:`store_add_norm` for ``y: (1, N)`` in fp32 (bias added): ``(out, residual_out, parts)``,
    the sum of squares whole in ``parts[0]`` of ``n_parts``."""
    dt = residual.dtype
    s = (y.to(dt).float() + residual.float()).to(dt)
    out = (s.float() * (norm_weight.float() + offset)).to(dt)
    parts = torch.zeros(n_parts, dtype=torch.float32, device=y.device)
    parts[0] = s.float().pow(2).sum()
    return out, s, parts


def reads_bf16_quads(x: torch.Tensor) -> bool:
    """Whether a GEMV may read ``x`` four bf16 values an int64 (:func:`int64_halves`): bf16, a row stride that is a
    multiple of 4 and an 8-byte-aligned start."""
    return x.dtype == torch.bfloat16 and x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0


def split_k_reduce(ws: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out (M, N) = ws.sum(0) + bias`` for the fp32 partial sums ``ws: (SPLIT_K, M, N)``."""
    split, m, n = ws.shape
    block = 1024
    maybe_wrap(_split_k_reduce_kernel)[(triton.cdiv(m * n, block),)](
        ws, bias if bias is not None else ws, out, m * n, n, SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block,
        INTERPRETED=INTERPRET, num_warps=4, **pdl_options(out))
    return out


_SMS: dict[int, int] = {}
_SMEM: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (8 for the CPU interpreter, so tests exercise split-K)."""
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def smem_bytes(device: torch.device) -> int:
    """Shared memory one program may use on a CUDA device (opt-in maximum); unbounded (2^31) for the interpreter."""
    if device.type != "cuda":
        return 1 << 31
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMEM:
        _SMEM[index] = torch.cuda.get_device_properties(index).shared_memory_per_block_optin
    return _SMEM[index]


def dense_path(x: torch.Tensor, min_tokens: int) -> bool:
    """Whether a quantized ``x @ W^T`` should run as dequantise-then-cuBLAS: CUDA, 16-bit activations, at least
    ``min_tokens`` rows, and not inside CUDA-graph capture (the transient ``(N, K)`` weight would stay reserved in the
    graph's memory pool).

    Large token counts are compute-bound: the fused GEMMs reach about half of cuBLAS's rate there, while writing one
    layer's dequantised weight costs about what reading it at 16 bits would (it is freed right after the matmul).
    """
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and x.shape[0] >= min_tokens
            and not torch.cuda.is_current_stream_capturing())


def split_k_plan(split_k: int, tiles: int, k_steps: int, out: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """``(steps_per_split, splits, dest)`` for a GEMM of ``tiles`` output tiles over ``k_steps`` K steps.

    ``split_k`` 0 lets :func:`choose_split_k` decide; ``dest`` is ``out`` itself unsplit, else a fresh fp32
    ``(splits, M, N)`` workspace for :func:`split_k_reduce`.
    """
    split = split_k or choose_split_k(tiles, k_steps, num_sms(out.device))
    per_split = -(-k_steps // split)
    split = -(-k_steps // per_split)
    dest = out if split == 1 else torch.empty((split, *out.shape), dtype=torch.float32, device=out.device)
    return per_split, split, dest


def choose_split_k(tiles: int, k_steps: int, sms: int, min_steps: int = 4) -> int:
    """Split the K loop until the grid covers the GPU about twice, keeping ``min_steps`` K steps per split.

    Skinny products (a handful of tokens times a narrow output) otherwise leave most SMs idle.
    """
    split = 1
    while tiles * split < 2 * sms and k_steps // (split * 2) >= min_steps and split < 16:
        split *= 2
    return split
