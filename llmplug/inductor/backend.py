"""``torch.compile(model, backend="llmplug")``: Inductor with llmplug's graph passes.

Registered with Dynamo when :mod:`llmplug` is imported, and through the ``torch_dynamo_backends`` entry point
(so ``torch.compile(..., backend="llmplug")`` and HF's ``CompileConfig(backend="llmplug")`` find it).
"""

from __future__ import annotations

import torch


def llmplug_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """Compile ``gm`` with Inductor, llmplug's passes installed before any post-grad pass the user set."""
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from .passes import LlmplugPass

    user = inductor_config.post_grad_custom_post_pass
    if isinstance(user, LlmplugPass):  # nested compile: already ours
        user = user.after
    with inductor_config.patch(post_grad_custom_post_pass=LlmplugPass(user)):
        return compile_fx(gm, example_inputs, **kwargs)


def register() -> None:
    """Make ``backend="llmplug"`` known to Dynamo (idempotent)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "llmplug" not in _BACKENDS:
        register_backend(name="llmplug")(llmplug_backend)
