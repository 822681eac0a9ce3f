"""Run a function on N CPU processes joined by gloo (``torch.distributed``), as ``torchrun`` would on GPUs."""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _detached(value):
    """``value`` with every tensor copied into a numpy array, so it outlives this process (a tensor would travel as
    a handle to this process's shared memory)."""
    if isinstance(value, torch.Tensor):
        return _Array(value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def _attached(value):
    if isinstance(value, _Array):
        return value.tensor()
    if isinstance(value, dict):
        return {k: _attached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_attached(v) for v in value)
    return value


class _Array:
    """A tensor's bytes as a numpy array (any dtype, bf16 and fp8 too), its dtype and shape."""

    def __init__(self, t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        self.bytes, self.dtype, self.shape = t.reshape(-1).view(torch.uint8).numpy(), t.dtype, tuple(t.shape)

    def tensor(self) -> torch.Tensor:
        if self.bytes.size == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.from_numpy(self.bytes.copy()).view(self.dtype).reshape(self.shape)


def _worker(rank: int, size: int, store: str, fn, args, queue, backend: str, kernels: bool, env: dict) -> None:
    from llmplug.ops._triton import INTERPRET, cpu_kernels

    os.environ.clear()  # the caller's environment now, not the one the fork server started with
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU a rank, NVLink multicast off (it can take a shared host's GPUs down)
            os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=60))
        with cpu_kernels(kernels and INTERPRET):
            queue.put((rank, _detached(fn(rank, *args)), None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_PRELOAD = ["torch", "transformers", "llmplug", "tests.tiny_models"]


def _context(backend: str):
    """How ranks start. gloo: forked by one server process that imported torch, transformers and llmplug once
    (``forkserver``), so a rank starts without its ~7 s of imports; variables read at import time
    (``TRITON_INTERPRET``) are the server's, the rest of the caller's environment is set again in each rank (see
    :func:`_worker`). nccl: spawned, each rank a fresh interpreter that initializes CUDA itself."""
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(size: int, fn, *args, timeout: float = 300.0, reporting: int | None = None,
              backend: str = "gloo", kernels: bool = False) -> list:
    """``fn(rank, *args)`` on ``size`` processes (a module-level function) joined by ``backend`` (``"nccl"``: one GPU
    a rank); its results by rank (None for a rank that never reported, when only ``reporting`` of them are expected
    to). Raises with a rank's traceback if one failed.

    ``kernels``: the ranks' CPU tensors go through the interpreted Triton kernels (under ``TRITON_INTERPRET=1``), as
    the suite's one-process tests run them; otherwise through the references, ~20x faster on a 2-core machine. The
    kernels are tested on their own on odd shapes; under a split they meet narrower ones, which the four families'
    test and the quantized linears' cover.
    """
    ctx = _context(backend)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        env = dict(os.environ)
        procs = [ctx.Process(target=_worker, args=(r, size, store, fn, args, queue, backend, kernels, env))
                 for r in range(size)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        try:
            for _ in range(size if reporting is None else reporting):
                rank, value, error = queue.get(timeout=timeout)
                if error is not None:
                    raise RuntimeError(f"rank {rank} failed:\n{error}")
                results[rank] = _attached(value)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return [results.get(r) for r in range(size)]
