"""The native modules TorchRec's TPU package imports but does not ship, served by an import hook.

TorchRec 1.9's ``torchrec.experimental.torch_tpu.datasets.input_preprocessing`` imports
``torchrec.experimental.torch_tpu.datasets.pybind_input_preprocessing``, a pybind11 extension
built against jax-tpu-embedding that its wheel leaves out (TorchTPU's environment provides it).
:func:`install` (run by ``import torch_tpu``) puts a finder on ``sys.meta_path`` that answers for
that one name, after the regular finders, with a module whose ``SparseCorePreprocessorBackend`` is
``sparsecore.metadata_backend.SparseCorePreprocessorBackend`` (same constructor and ``preprocess``;
the buffers jax-tpu-embedding's C++ builds). A real extension found on the path wins.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

PREPROCESSING_MODULE = "torchrec.experimental.torch_tpu.datasets.pybind_input_preprocessing"


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


def install() -> None:
    """Append the finder to ``sys.meta_path`` (once)."""
    if not any(isinstance(f, TorchRecNativeFinder) for f in sys.meta_path):
        sys.meta_path.append(TorchRecNativeFinder())
