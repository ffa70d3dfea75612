"""What TorchRec's TPU package expects of TorchTPU's environment at import: a native module it
does not ship, and the input checks at the points where it hands the project its configs and ids.

TorchRec 1.9's ``torchrec.experimental.torch_tpu.datasets.input_preprocessing`` imports
``torchrec.experimental.torch_tpu.datasets.pybind_input_preprocessing``, a pybind11 extension
built against jax-tpu-embedding that its wheel leaves out (TorchTPU's environment provides it).
:func:`install` (run by ``import torch_tpu``) puts a finder on ``sys.meta_path`` that answers for
that one name, after the regular finders, with a module whose ``SparseCorePreprocessorBackend`` is
``sparsecore.metadata_backend.SparseCorePreprocessorBackend`` (same constructor and ``preprocess``;
the buffers jax-tpu-embedding's C++ builds). A real extension found on the path wins.

Checks (:mod:`sparsecore.torchrec_tpu_checks`): TorchRec narrows ids to int32 and splits the KJT by
feature before the backend sees them, and it never checks its table configs. So, as its modules
load (or at once, when already loaded), its stacking functions (``prepare_tables_for_stacking``,
which every fused collection and the preprocessor call on their tables first, ``stack_tables``,
``auto_stack_tables``) and ``SparseCoreInputPreprocessor.__call__`` are wrapped: the tables and
the KJT are checked, then TorchRec's function runs as is.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

PREPROCESSING_MODULE = "torchrec.experimental.torch_tpu.datasets.pybind_input_preprocessing"
STACKING_MODULE = "torchrec.experimental.torch_tpu.modules.table_stacking"
PREPROCESSOR_MODULE = "torchrec.experimental.torch_tpu.datasets.input_preprocessing"
_CHECKED = "__torch_tpu_checked__"  # marks a function wrapped here
# TorchRec's functions taking the table configs first (the fused collections and the preprocessor
# stack their tables through them before anything else)
_STACKING_FUNCTIONS = ("stack_tables", "auto_stack_tables", "prepare_tables_for_stacking")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        from sparsecore.metadata_backend import SparseCorePreprocessorBackend

        module.SparseCorePreprocessorBackend = SparseCorePreprocessorBackend
        module.__doc__ = "TorchRec TPU's host preprocessing backend, served by torch_tpu (sparsecore)."


class TorchRecNativeFinder(importlib.abc.MetaPathFinder):
    """Finds :data:`PREPROCESSING_MODULE` when no other finder does."""

    def find_spec(self, fullname: str, path: object = None, target: object = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != PREPROCESSING_MODULE:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), origin="torch_tpu")


def _checked(original: Callable[..., Any], check: Callable[..., None]) -> Callable[..., Any]:
    """``original`` running ``check`` on its arguments first (once, however often applied)."""
    if getattr(original, _CHECKED, False):
        return original

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(run, _CHECKED, True)
    return run


def _check_tables(tables: Any, *args: Any, **kwargs: Any) -> None:
    from sparsecore.torchrec_tpu_checks import check_sparsecore_tables

    check_sparsecore_tables(tables)


def _check_batch(preprocessor: Any, features: Any) -> None:
    from sparsecore.torchrec_tpu_checks import check_preprocessor_input

    check_preprocessor_input(features, preprocessor._tables, preprocessor._batch_size)


def _guard(module: ModuleType) -> None:
    """Wrap the functions of TorchRec module ``module`` that take the checked inputs."""
    for name in _STACKING_FUNCTIONS:
        if hasattr(module, name):
            setattr(module, name, _checked(getattr(module, name), _check_tables))
    if module.__name__ == PREPROCESSOR_MODULE:
        cls = module.SparseCoreInputPreprocessor
        cls.__call__ = _checked(cls.__call__, _check_batch)


class _GuardingLoader(importlib.abc.Loader):
    """A module's own loader, then :func:`_guard` on the loaded module."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _guard(module)


class TorchRecGuardFinder(importlib.abc.MetaPathFinder):
    """Finds TorchRec's stacking and preprocessing modules with the other finders and guards them
    once loaded."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in (STACKING_MODULE, PREPROCESSOR_MODULE):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _GuardingLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Append the native-module finder and put the guard finder first on ``sys.meta_path`` (once);
    guard TorchRec's modules already loaded."""
    if not any(isinstance(f, TorchRecNativeFinder) for f in sys.meta_path):
        sys.meta_path.append(TorchRecNativeFinder())
    if not any(isinstance(f, TorchRecGuardFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchRecGuardFinder())
    for name in (STACKING_MODULE, PREPROCESSOR_MODULE):
        if name in sys.modules:
            _guard(sys.modules[name])
