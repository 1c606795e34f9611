"""Every Triton kernel reads only module globals that Triton's compiler accepts.

Triton's interpreter, which runs the kernels in the CPU tests, reads any global; the
compiler accepts only `tl.constexpr` values (besides modules and functions) and fails at
the kernel's first launch on a GPU. This check holds the kernels to the compiler's rule.
"""
from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

from conftest import interpret_kernels_without_cuda

interpret_kernels_without_cuda()

import triton.language as tl  # noqa: E402

import windowgpt_cli.kernels as kernel_package  # noqa: E402


def kernel_modules() -> list[types.ModuleType]:
    return [importlib.import_module(f"{kernel_package.__name__}.{info.name}")
            for info in pkgutil.iter_modules(kernel_package.__path__)]


def kernels(module: types.ModuleType) -> dict[str, types.FunctionType]:
    """{name: the Python function} of the module's own @triton.jit kernels."""
    found = {}
    for name, value in vars(module).items():
        fn = getattr(value, "fn", None)
        if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
            found[name] = fn
    return found


def refused_globals(fn: types.FunctionType) -> list[str]:
    """The module globals the function reads that are values but not tl.constexpr."""
    names = set(fn.__code__.co_names)
    return sorted(name for name in names if name in fn.__globals__
                  and isinstance(fn.__globals__[name], (bool, int, float, str, bytes))
                  and not isinstance(fn.__globals__[name], tl.constexpr))


def test_the_kernel_package_has_kernels_to_check():
    assert sum(len(kernels(module)) for module in kernel_modules()) >= 20


@pytest.mark.parametrize("module", kernel_modules(), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_kernels_read_no_global_value_that_is_not_a_constexpr(module):
    problems = {name: refused for name, fn in kernels(module).items() if (refused := refused_globals(fn))}
    assert problems == {}


def test_the_check_finds_a_plain_number_read_by_a_kernel():
    namespace = {"LIMIT": 3.0, "FINE": tl.constexpr(1.0)}
    exec("def kernel(x):\n    return x * LIMIT + FINE\n", namespace)
    assert refused_globals(namespace["kernel"]) == ["LIMIT"]
