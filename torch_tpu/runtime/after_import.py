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
    right after it is (at most one pending call per (name, fn); several functions per module run in
    the order given)."""
    module = sys.modules.get(name)
    if module is not None and hasattr(module, ready):
        fn()
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == name), None)
    if finder is None:
        finder = _AfterImport(name)
        sys.meta_path.insert(0, finder)
    if fn not in finder.fns:
        finder.fns.append(fn)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds module ``name`` with the normal finder, then calls each of ``fns`` after its module
    body (one finder per module: the import system asks only the first finder that answers)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fns: list[Callable[[], None]] = []

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
            for fn in self.fns:
                fn()

        spec.loader.exec_module = exec_then_call
        return spec
