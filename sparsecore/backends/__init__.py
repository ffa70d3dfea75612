"""Lookup backends behind one interface (``Backend``), by name: ``xla``, ``fbgemm`` and ``tpu``
here, and those a package above registers (:func:`register_backend`: ``torchrec_tpu.sharding``'s
``ops``, the tpu:: SparseCore ops on the tpu device)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import torch

from sparsecore.backends.base import Backend
from sparsecore.stacking import StackingPlan

# name -> "module:Class", imported when a backend of that name is made (the heavy imports happen then)
_REGISTRY: dict[str, str] = {"xla": "sparsecore.backends.xla:XlaBackend",
                             "fbgemm": "sparsecore.backends.fbgemm:FbgemmBackend",
                             "tpu": "sparsecore.backends.tpu:TpuBackend"}


def register_backend(name: str, where: str) -> None:
    """Make backend ``name`` the class ``where`` (``"module:Class"``, imported on first use)."""
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
        raise ValueError(f"unknown backend {name!r}; choose one of {backend_names()}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(plan, weights, seed, **options)
