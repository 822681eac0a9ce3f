"""The llmplug backend's CUDA graphs (``mode="reduce-overhead"``), in place of Inductor's CUDA-graph trees.

A compiled call's inputs are static (parameters, and tensors Dynamo marked static: HF's ``StaticCache`` tensors) or
not (the step's token ids, positions, mask). :class:`GraphedCall` runs the first call as it is (warm-up), then
captures one graph per set of static-input addresses and replays it: the other inputs are copied into the graph's own
buffers before the replay and back out after it (so a graph that writes an input writes the caller's tensor), and the
outputs are copied out of the graph's memory (a caller may keep them across calls). Static inputs are used where they
lie, written in place as the graph writes them. Where a capture cannot be used (it fails; an output is a view of an
input, shares memory with another or is no tensor; inputs share memory or cannot be copied into) the compiled call runs
without a graph, with a one-time warning.
NOTE: a prototype's decode-call host time inside the backend, 8B shape: 0.13 ms against the trees' 0.33 (H200,
2026-12-02; BENCHMARKS.md, "Session of 2026-12-02").
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from ..ops._triton import programmatic_launch

MAX_GRAPHS = 4  # graphs kept a compiled call (HF builds a new static cache when a call's lengths change)


def is_static(t) -> bool:
    """``t`` stays at one address from call to call: a parameter, or a tensor Dynamo was told is static
    (``torch._dynamo.mark_static_address``, as HF's ``StaticCache`` does; Dynamo's own lifted buffers)."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None


def why_not(example_inputs: Sequence) -> str | None:
    """Why a graph of these inputs is left to Inductor's own CUDA graphs (None: :class:`GraphedCall` takes it)."""
    if not all(isinstance(t, torch.Tensor) for t in example_inputs):
        return "non-tensor inputs (dynamic shapes)"
    if len({t.device for t in example_inputs}) != 1 or not example_inputs or example_inputs[0].device.type != "cuda":
        return "inputs not all on one CUDA device"
    if torch.is_grad_enabled() and any(t.requires_grad for t in example_inputs):
        return "a graph autograd records"
    return None


def _ptrs_equal(args: list, ptrs: list, idxs: list[int]) -> bool:
    """``args[i].data_ptr() == ptrs[i]`` for every ``i`` in ``idxs``."""
    check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)  # C++: CUDA builds
    if check is not None:
        return check(args, ptrs, idxs)
    return all(args[i].data_ptr() == ptrs[i] for i in idxs)


class _Captured:
    """One captured graph: its static inputs' addresses, its buffers for the other inputs and its outputs."""

    def __init__(self, graph, ptrs: list, buffers: list[torch.Tensor], outputs: list[torch.Tensor], as_type) -> None:
        self.graph, self.ptrs, self.buffers, self.outputs, self.as_type = graph, ptrs, buffers, outputs, as_type

    def replay(self, inputs: list[torch.Tensor]):
        """Copy ``inputs`` (the call's non-static ones) in, replay, copy them back; fresh copies of the outputs."""
        if inputs:
            torch._foreach_copy_(self.buffers, inputs)
        self.graph.replay()
        if inputs:
            torch._foreach_copy_(inputs, self.buffers)  # what the graph wrote into an input reaches the caller's
        return self.as_type(o.clone() for o in self.outputs)


class GraphedCall:
    """A compiled call (Inductor's output, compiled without CUDA graphs) run through captured CUDA graphs.

    Args:
        compiled: the compiled callable, ``compiled(*inputs) -> list | tuple`` of tensors.
        example_inputs: the inputs it was compiled for (which are static is read off them).
        new_graph: makes an empty graph (``torch.cuda.CUDAGraph``; tests pass a stand-in).
    """

    def __init__(self, compiled: Callable, example_inputs: Sequence[torch.Tensor],
                 new_graph: Callable = torch.cuda.CUDAGraph) -> None:
        self.compiled, self.new_graph = compiled, new_graph
        self.static = [i for i, t in enumerate(example_inputs) if is_static(t)]
        self.dynamic = [i for i, t in enumerate(example_inputs) if not is_static(t)]
        self.graphs: list[_Captured] = []  # the one used last first
        self.warmed = False
        self.ungraphed: str | None = None  # why this call runs without a graph, once it does
        self.pool = None

    def __call__(self, *args):
        if self.ungraphed is None:
            inputs = list(args)
            for i, captured in enumerate(self.graphs):
                if _ptrs_equal(inputs, captured.ptrs, self.static):
                    if i:
                        self.graphs.insert(0, self.graphs.pop(i))
                    return captured.replay([inputs[j] for j in self.dynamic])
            if self.warmed:
                captured = self._capture(inputs)
                if captured is not None:
                    return captured.replay([inputs[j] for j in self.dynamic])
            self.warmed = True
        with programmatic_launch():  # warm-up (Triton, cuBLAS and autotuning settle before a capture), or no graph
            return self.compiled(*args)

    def _capture(self, inputs: list) -> _Captured | None:
        """Capture a graph for these inputs' static addresses (kept first, the oldest beyond ``MAX_GRAPHS``
        dropped), or None (after warning once) where its outputs could not be handed out as copies."""
        reason = None
        buffers = [torch.empty_strided(inputs[j].shape, inputs[j].stride(), dtype=inputs[j].dtype,
                                       device=inputs[j].device) for j in self.dynamic]
        storages = [inputs[j].untyped_storage().data_ptr() for j in self.dynamic]
        if any(torch._debug_has_internal_overlap(b) == 1 or inputs[j].is_inference() and not
               torch.is_inference_mode_enabled() for b, j in zip(buffers, self.dynamic, strict=True)):
            reason = "an input that cannot be copied into (expanded, or an inference tensor)"
        elif len(set(storages)) < len(storages) or \
                set(storages) & {inputs[i].untyped_storage().data_ptr() for i in self.static}:
            reason = "inputs that share memory (copied in and out apart, a write to one would be lost)"
        else:
            args = list(inputs)
            for b, j in zip(buffers, self.dynamic, strict=True):
                args[j] = b
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle() if self.new_graph is torch.cuda.CUDAGraph else None
            graph = self.new_graph()
            try:
                with programmatic_launch(), _capturing(graph, self.pool):
                    outputs = self.compiled(*args)
            except Exception as e:  # a capture can fail only here, before anything of this call ran
                reason = f"its capture failed ({type(e).__name__}: {e})"
            else:
                reason = _unsafe_outputs(outputs, args)
        if reason is not None:
            self.ungraphed = reason
            warnings.warn(f"llmplug's torch.compile backend runs a compiled graph without CUDA graphs: {reason}",
                          stacklevel=3)
            return None
        static = set(self.static)
        ptrs = [t.data_ptr() if i in static else None for i, t in enumerate(inputs)]
        captured = _Captured(graph, ptrs, buffers, list(outputs), type(outputs))
        self.graphs = [captured, *self.graphs[:MAX_GRAPHS - 1]]
        return captured


def _capturing(graph, pool):
    """The context that records ``graph`` (a stand-in graph records itself)."""
    if isinstance(graph, torch.cuda.CUDAGraph):
        return torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")
    return graph.capture()


def _unsafe_outputs(outputs, inputs: list) -> str | None:
    """Why ``outputs`` cannot be handed out as copies after each replay (None: they can)."""
    if not isinstance(outputs, (list, tuple)) or not all(isinstance(o, torch.Tensor) for o in outputs):
        return "an output that is not a tensor"
    held = {t.untyped_storage().data_ptr() for t in inputs}
    storages = [o.untyped_storage().data_ptr() for o in outputs]
    if any(s in held for s in storages):
        return "an output that is a view of an input"
    if len(set(storages)) < len(storages):
        return "outputs that share memory"
    return None
