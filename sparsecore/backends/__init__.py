"""Lookup backends behind one interface (``Backend``), by name.

The backend names are defined here once (:data:`BackendName`), and whatever names a backend takes
them from here (the train CLI's ``--sparse-backend``, the sharded tables, the step layout):

* ``xla``: this package's own XLA programs (:mod:`sparsecore.backends.xla`);
* ``fbgemm``: FBGEMM's table-batched embedding CPU kernels (:mod:`sparsecore.backends.fbgemm`);
* ``tpu``: jax-tpu-embedding's SparseCore kernels, which only a TPU executes (:mod:`sparsecore.backends.tpu`);
* ``ops``: the tpu:: SparseCore ops on the tpu device; its class lives above this package
  (``torchrec_tpu.sharding``, it needs torch_tpu), which registers it (:func:`register_backend`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:  # (the names alone stay light: the train CLI's --help reads them without torch)
    import torch

    from sparsecore.backends.base import Backend
    from sparsecore.stacking import StackingPlan

BackendName = Literal["xla", "fbgemm", "tpu", "ops"]
BACKENDS: tuple[BackendName, ...] = get_args(BackendName)
XLA, FBGEMM, TPU, OPS = BACKENDS

# name -> "module:Class", imported when a backend of that name is made (the heavy imports happen then)
_REGISTRY: dict[str, str] = {XLA: "sparsecore.backends.xla:XlaBackend",
                             FBGEMM: "sparsecore.backends.fbgemm:FbgemmBackend",
                             TPU: "sparsecore.backends.tpu:TpuBackend"}
_REGISTERED_ABOVE = {OPS: "torchrec_tpu.sharding"}  # name -> the package that registers its class


def register_backend(name: str, where: str) -> None:
    """Make backend ``name`` (one of :data:`BACKENDS`) the class ``where`` (``"module:Class"``,
    imported on first use)."""
    if name not in BACKENDS:
        raise ValueError(f"backend name {name!r} is not one of {BACKENDS} (sparsecore.backends.BackendName)")
    if _REGISTRY.get(name, where) != where:
        raise ValueError(f"backend {name!r} is already {_REGISTRY[name]}")
    _REGISTRY[name] = where


def backend_names() -> tuple[str, ...]:
    """Every registered backend's name."""
    return tuple(_REGISTRY)


def make_backend(name: str, plan: StackingPlan, weights: Mapping[str, torch.Tensor] | None = None,
                 seed: int = 0, **options) -> Backend:
    """Build backend ``name`` for ``plan``; its module is imported here."""
    if name not in _REGISTRY:
        if name in _REGISTERED_ABOVE:
            raise ValueError(f"backend {name!r} is registered by {_REGISTERED_ABOVE[name]}: import it first")
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(plan, weights, seed, **options)
