"""``torch.compile(model, backend="llmplug")``: Inductor with llmplug's graph passes.

Dynamo finds it through the installed package's ``torch_dynamo_backends`` entry point (so
``torch.compile(..., backend="llmplug")`` and HF's ``CompileConfig(backend="llmplug")`` work without importing
llmplug); :func:`register` does the same for a checkout used without installing (registering at ``import llmplug``
would load Dynamo, ~0.85 s, for every user).
"""

from __future__ import annotations

import os

import torch

# the private Inductor / Dynamo APIs the backend stands on (module, attribute); tests pin them on the CPU's torch
# and the GPU machine's
PRIVATE_APIS = (("torch._inductor.config", "post_grad_custom_post_pass"), ("torch._inductor.config", "patch"),
                ("torch._inductor.config", "fx_graph_cache"), ("torch._inductor.compile_fx", "compile_fx"),
                ("torch._inductor.custom_graph_pass", "CustomGraphPass"),
                ("torch._dynamo.backends.registry", "register_backend"), ("torch", "_TorchCompileInductorWrapper"),
                ("torch._inductor.pattern_matcher", "register_replacement"),
                ("torch._inductor.pattern_matcher", "PatternMatcherPass"),
                ("torch._inductor.pattern_matcher", "fwd_only"),
                ("torch._higher_order_ops.auto_functionalize", "auto_functionalized"),
                ("torch._dynamo", "mark_static_address"), ("torch", "_debug_has_internal_overlap"),
                ("torch", "_foreach_copy_"))


def check_apis() -> None:
    """Raise a clear ``RuntimeError`` where this torch lacks one of :data:`PRIVATE_APIS`."""
    import importlib

    for module, name in PRIVATE_APIS:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            raise RuntimeError(f"llmplug's torch.compile backend needs {module}.{name}, which torch "
                               f"{torch.__version__} does not have (Inductor's private API moved); compile with the "
                               "default backend, or use torch 2.11-2.13")


def llmplug_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """Compile ``gm`` with Inductor, llmplug's passes installed before any post-grad pass the user had set.

    ``mode`` and ``options`` mean what they mean to ``torch.compile``'s Inductor (``"reduce-overhead"``: CUDA graphs,
    as HF's ``CompileConfig`` asks by default); Dynamo hands them to a named backend as keywords. The CUDA graphs are
    llmplug's own (:mod:`llmplug.inductor.cuda_graphs`) where it can take the graph, Inductor's trees otherwise or
    with ``LLMPLUG_CUDAGRAPH_TREES=1`` in the environment (a debugging toggle)."""
    check_apis()
    import torch._inductor.config as inductor_config

    from ..ops._triton import programmatic_launch
    from .cuda_graphs import GraphedCall, why_not
    from .passes import LlmplugPass

    inductor = torch._TorchCompileInductorWrapper(mode, options, None)  # Inductor's own reading of mode and options
    own_graphs = inductor.config.get("triton.cudagraphs", False) and why_not(example_inputs) is None and \
        os.environ.get("LLMPLUG_CUDAGRAPH_TREES", "0") == "0"
    if own_graphs:
        inductor.config["triton.cudagraphs"] = False
    user = inductor_config.post_grad_custom_post_pass
    if isinstance(user, LlmplugPass):  # nested compile: already ours
        user = user.after
    with inductor_config.patch(post_grad_custom_post_pass=LlmplugPass(user)):
        compiled = inductor(gm, example_inputs)
    if own_graphs:
        return GraphedCall(compiled, example_inputs)

    def run(*args):
        # llmplug's kernels may start under their predecessors' tails (Hopper's programmatic dependent launch): a
        # graph's weights are its inputs, which nothing in it writes (the GEMV pass matches no computed weight)
        with programmatic_launch():
            return compiled(*args)

    return run


def register() -> None:
    """Make ``backend="llmplug"`` known to Dynamo (idempotent)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "llmplug" not in _BACKENDS:
        register_backend(name="llmplug")(llmplug_backend)
