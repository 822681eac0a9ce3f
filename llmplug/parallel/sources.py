"""Where a tensor-parallel split reads each rank's slice of a weight from: the model itself (in place), a local
safetensors checkpoint (only the slice's bytes, for models too big for one device), or fresh random values (benchmark
shapes). Each gives ``part(owner, name, dim, start, stop)`` (rows or columns ``[start, stop)`` of ``owner.name``)
and ``whole(owner, name)`` on its ``device`` (where the split model lives), and says with ``holds(owner, name)``
whether it has a value for a buffer (a computed one, such as rotary frequencies, keeps the value it was made with)."""

from __future__ import annotations

import json
import os
import zlib

import torch


class InPlace:
    """Slices of the weights the model already holds (on ``device``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def part(self, owner: torch.nn.Module, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return getattr(owner, name).data.narrow(dim, start, stop - start).contiguous()

    def whole(self, owner: torch.nn.Module, name: str) -> torch.Tensor:
        return getattr(owner, name).data

    def holds(self, owner: torch.nn.Module, name: str) -> bool:
        return True


class Checkpoint:
    """The tensors of a local safetensors checkpoint (``model.safetensors`` or shards with an index) under the
    model's state-dict names, read slice by slice (``safe_open(...).get_slice``), in the dtype of the (meta) tensor
    each replaces, on ``device``.

    Args:
        path: the checkpoint directory.
        model: the model (on the meta device) whose parameters and buffers the names map to.
    """

    def __init__(self, path: str | os.PathLike, model: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.files = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            from safetensors import safe_open

            single = os.path.join(path, "model.safetensors")
            if not os.path.exists(single):
                raise FileNotFoundError(f"{path} has no model.safetensors (or index): only safetensors "
                                        "checkpoints load split")
            with safe_open(single, "pt") as f:
                self.files = dict.fromkeys(f.keys(), single)
        self.names = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            for name in list(module._parameters) + list(module._buffers):
                key = f"{prefix}.{name}" if prefix else name
                if key in self.files:
                    self.names.setdefault((id(module), name), key)

    def key(self, owner: torch.nn.Module, name: str) -> str | None:
        """The checkpoint's name for ``owner.name``, or None where it holds none (a tied or computed tensor)."""
        return self.names.get((id(owner), name))

    def _read(self, owner: torch.nn.Module, name: str, dim: int | None, start: int = 0, stop: int = 0):
        from safetensors import safe_open

        key = self.key(owner, name)
        if key is None:
            raise KeyError(f"the checkpoint holds no tensor for {type(owner).__name__}.{name}")
        with safe_open(self.files[key], "pt") as f:
            part = f.get_slice(key)
            if dim is None:
                t = part[:]
            else:
                index = [slice(None)] * len(part.get_shape())
                index[dim] = slice(start, stop)
                t = part[tuple(index)]
        like = getattr(owner, name)  # the meta tensor it replaces: its dtype (fp32 scales stay fp32)
        return t.to(self.device, dtype=like.dtype if like is not None else t.dtype).contiguous()

    def part(self, owner: torch.nn.Module, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self._read(owner, name, dim, start, stop)

    def whole(self, owner: torch.nn.Module, name: str) -> torch.Tensor:
        return self._read(owner, name, None)

    def holds(self, owner: torch.nn.Module, name: str) -> bool:
        return self.key(owner, name) is not None


class RandomInit:
    """Random values of each slice's shape (normal, std 0.02; norm weights and other 1-D tensors ones), seeded by the
    tensor's name and slice: benchmark shapes too big for one device, built split. Values differ from any
    one-process model's."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.names = {(id(m), n): f"{p}.{n}" for p, m in model.named_modules(remove_duplicate=False)
                      for n in list(m._parameters) + list(m._buffers)}

    def _make(self, owner: torch.nn.Module, name: str, shape: tuple[int, ...], tag: str) -> torch.Tensor:
        if len(shape) < 2:
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        seed = zlib.crc32(f"{self.names.get((id(owner), name), name)}:{tag}".encode())
        g = torch.Generator(self.device).manual_seed(seed)
        return (torch.randn(shape, generator=g, device=self.device, dtype=torch.float32) * 0.02).to(self.dtype)

    def part(self, owner: torch.nn.Module, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        shape = list(getattr(owner, name).shape)
        shape[dim] = stop - start
        return self._make(owner, name, tuple(shape), f"{dim}:{start}:{stop}")

    def whole(self, owner: torch.nn.Module, name: str) -> torch.Tensor:
        return self._make(owner, name, tuple(getattr(owner, name).shape), "whole")

    def holds(self, owner: torch.nn.Module, name: str) -> bool:
        return name in owner._parameters  # buffers are computed: they keep their values
