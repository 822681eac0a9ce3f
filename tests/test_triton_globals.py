"""Every llmplug Triton kernel reads only the globals compiled Triton lets a kernel read: modules, other kernels,
``tl.constexpr`` values, Triton's own objects and a few builtins. The interpreter (the CPU tests' path) runs the kernel
as Python and allows any global, so a plain ``NAME = 5`` read inside a kernel passed the CPU tests and failed to compile
on the GPU (2026-11-27, ``llmplug/ops/argmax.py``). This test applies compiled Triton's rule
(``triton/compiler/code_generator.py``, ``global_lookup``) to each kernel's bytecode."""

import dis
import importlib
import pkgutil
import types

import pytest

import llmplug

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.runtime import interpreter, jit  # noqa: E402

# a jitted function: compiled (JITCallable is the base class in newer Triton) or, under TRITON_INTERPRET=1, interpreted
JIT = (getattr(jit, "JITCallable", jit.JITFunction), interpreter.InterpretedFunction)
BUILTINS = {"len", "list", "range", "float", "int", "isinstance", "getattr", "hasattr", "print", "min", "max"}


def _allowed(name: str, value) -> bool:
    return (name in BUILTINS or isinstance(value, (types.ModuleType, *JIT, tl.constexpr, tl.dtype))
            or getattr(value, "__triton_builtin__", False) or getattr(value, "__triton_aggregate__", False)
            or getattr(value, "__module__", "").startswith("triton.language"))


def _global_names(code: types.CodeType):
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL":
            yield ins.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _kernels() -> dict[str, object]:
    found = {}
    for info in pkgutil.walk_packages(llmplug.__path__, "llmplug."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, JIT) and getattr(value, "fn", None) is not None:
                found[f"{value.fn.__module__}.{value.fn.__qualname__}"] = value.fn
    return found


def _bad(kernels: dict) -> list[tuple[str, str]]:
    absent = object()
    return sorted((kernel, name) for kernel, fn in kernels.items() for name in set(_global_names(fn.__code__))
                  if (value := fn.__globals__.get(name, absent)) is not absent and not _allowed(name, value))


def test_kernels_read_only_globals_compiled_triton_allows():
    kernels = _kernels()
    assert len(kernels) > 30  # the walk found llmplug's kernels
    assert _bad(kernels) == []


def test_a_plain_global_is_caught():
    namespace = {"tl": tl, "triton": triton, "LIMIT": 2147483647}
    exec("def kernel(x_ptr):\n    tl.store(x_ptr, LIMIT)\n", namespace)  # noqa: S102 - a kernel made to be wrong
    assert _bad({"kernel": namespace["kernel"]}) == [("kernel", "LIMIT")]
