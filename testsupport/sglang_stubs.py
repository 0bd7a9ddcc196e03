"""Import-time stand-ins for three packages SGLang 0.5.23 imports on CPU but never runs here.

``triton`` (GPU kernels, no CPU wheel), ``torchvision`` (the index's build is CUDA's) and
``datasets`` (the benchmark tools' loaders) are imported by modules on the way to the host pool
and the cache controller, and used there only to declare kernels (``@triton.jit``, ``tl.constexpr``
annotations) or by code these tests never call. ``install()`` puts a finder first on
``sys.meta_path`` that answers those three names with modules whose every attribute is an
inert class: calling it with a function returns the function (a decorator), with anything else
a decorator; subscripting it returns it. A test that reached real triton code would fail at
that call, never compute something else.

Shared by ``tests/sglang`` and ``bench/sglang_backend.py``; imports only the standard library.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

STUBBED = ("triton", "torchvision", "datasets")


class _Inert(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Inert(name, (), {})
        setattr(cls, name, sub)
        return sub

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda f: f

    def __getitem__(cls, key: Any) -> Any:
        return cls


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Inert(name, (), {})
        setattr(self, name, sub)
        return sub


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # SGLang compares triton's version at import; any 3.x passes.
        module.__dict__["__version__"] = "3.5.0"


def install() -> Callable[[], None]:
    """Install the finder (once); returns a function that removes it."""
    finder = next((f for f in sys.meta_path if isinstance(f, _Finder)), None)
    if finder is None:
        finder = _Finder()
        sys.meta_path.insert(0, finder)
    return lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None
