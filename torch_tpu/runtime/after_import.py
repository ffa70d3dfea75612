"""Run a function as soon as a module is imported: now if it already is, else right after its
module body (a one-shot import hook). For patches and registrations against modules that cost
seconds to import (``torch._dynamo``, ``torch.distributed.tensor``), so ``import torch_tpu`` does
not load them."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any


def call_after_import(name: str, ready: str, fn: Callable[[], None]) -> None:
    """Call ``fn()`` now if module ``name`` is imported (it has the attribute ``ready``), else once
    right after it is (at most one pending call per (name, fn))."""
    module = sys.modules.get(name)
    if module is not None and hasattr(module, ready):
        fn()
    elif not any(isinstance(f, _AfterImport) and (f.name, f.fn) == (name, fn) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, fn))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds module ``name`` with the normal finder, then calls ``fn`` after its module body."""

    def __init__(self, name: str, fn: Callable[[], None]) -> None:
        self.name, self.fn = name, fn

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_call(module: Any) -> None:
            exec_module(module)
            self.fn()

        spec.loader.exec_module = exec_then_call
        return spec
