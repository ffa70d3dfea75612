"""The face's one ``sys.meta_path`` finder, :class:`TorchTpuFinder`: what code written for
TorchTPU expects of its environment at import.

* ``importlib.metadata.distribution("torch-tpu")`` / ``version("torch-tpu")`` (code written for
  TorchTPU asks for it by name) answer with this project standing in, version
  ``0.2.0+torchrec.tpu``; an installed ``torch-tpu`` wins, and the project's own ``torchrec-tpu`` is
  untouched.
* TorchRec's TPU package: a native module it does not ship, and the input checks at the points
  where it hands the project its configs and ids (below).

TorchRec 1.9's ``torchrec.experimental.torch_tpu.datasets.input_preprocessing`` imports
``torchrec.experimental.torch_tpu.datasets.pybind_input_preprocessing``, a pybind11 extension
built against jax-tpu-embedding that its wheel leaves out (TorchTPU's environment provides it).
The finder answers for that one name, when no other finder does, with a module whose
``SparseCorePreprocessorBackend`` is ``sparsecore.metadata_backend.SparseCorePreprocessorBackend``
(same constructor and ``preprocess``; the buffers jax-tpu-embedding's C++ builds). A real extension
found on the path wins.

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
import importlib.metadata
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

TORCHTPU_VERSION = "0.2.0"  # the TorchTPU release whose API this is (tests/torch_tpu/data/torchtpu_0_2_0_api.json)
DISTRIBUTION = "torch-tpu"

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


class _StandInDistribution(importlib.metadata.Distribution):
    """The ``torch-tpu`` distribution this project stands in for, version ``0.2.0+torchrec.tpu``
    (TorchTPU's API version, marked as this project's)."""

    def read_text(self, filename: str) -> str | None:
        if filename not in ("METADATA", "PKG-INFO"):
            return None
        return (f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: {TORCHTPU_VERSION}+torchrec.tpu\n"
                "Summary: TorchTPU's API (torch.tpu, torch_tpu) served by torchrec-tpu's torch_tpu package\n")

    def locate_file(self, path: str | Path) -> Path:
        return Path(__file__).resolve().parents[2] / path


class TorchTpuFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: guards TorchRec's stacking and preprocessing modules (found by
    the other finders) once loaded, serves :data:`PREPROCESSING_MODULE` and the ``torch-tpu``
    distribution where no other finder has them."""

    def _others(self) -> Iterator[Any]:
        return (f for f in list(sys.meta_path) if not isinstance(f, TorchTpuFinder))

    def _found_elsewhere(self, fullname: str, path: Any, target: Any) -> importlib.machinery.ModuleSpec | None:
        for finder in self._others():
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                return spec
        return None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in (STACKING_MODULE, PREPROCESSOR_MODULE, PREPROCESSING_MODULE):
            return None
        spec = self._found_elsewhere(fullname, path, target)
        if fullname == PREPROCESSING_MODULE:
            return spec or importlib.machinery.ModuleSpec(fullname, _Loader(), origin="torch_tpu")
        if spec is not None and spec.loader is not None:
            spec.loader = _GuardingLoader(spec.loader)
        return spec

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()
                           ) -> Iterator[importlib.metadata.Distribution]:
        if (context.name or "").replace("_", "-").lower() != DISTRIBUTION:
            return
        for finder in self._others():
            if next(iter(getattr(finder, "find_distributions", lambda _: ())(context)), None) is not None:
                return  # an installed torch-tpu
        yield _StandInDistribution()


def install() -> None:
    """Put :class:`TorchTpuFinder` first on ``sys.meta_path`` (once); guard TorchRec's modules
    already loaded."""
    if not any(isinstance(f, TorchTpuFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchTpuFinder())
    for name in (STACKING_MODULE, PREPROCESSOR_MODULE):
        if name in sys.modules:
            _guard(sys.modules[name])
