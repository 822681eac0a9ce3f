"""Reading a device tensor's values without stalling the host at launch time."""

from __future__ import annotations

import torch


class HostRead:
    """``tensor``'s values on their way to the host: on CUDA a pinned copy queued now, behind the work that makes
    them, so :meth:`values` later waits for that copy alone; elsewhere the tensor itself."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = tensor, None

    def values(self) -> list:
        """The values as (nested) Python lists."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
