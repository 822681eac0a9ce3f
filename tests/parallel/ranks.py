"""Run a function on N CPU processes joined by gloo (``torch.distributed``), as ``torchrun`` would on GPUs."""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, size: int, store: str, fn, args, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=60))
        queue.put((rank, fn(rank, *args), None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(size: int, fn, *args, timeout: float = 300.0) -> list:
    """``fn(rank, *args)`` on ``size`` processes (a module-level function); its results by rank. Raises with a rank's
    traceback if one failed."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, size, store, fn, args, queue)) for r in range(size)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        try:
            for _ in range(size):
                rank, value, error = queue.get(timeout=timeout)
                if error is not None:
                    raise RuntimeError(f"rank {rank} failed:\n{error}")
                results[rank] = value
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(size)]
