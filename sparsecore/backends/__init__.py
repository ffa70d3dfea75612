"""Lookup backends behind one interface (``Backend``): ``xla``, ``fbgemm`` and ``tpu``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sparsecore.backends.base import Backend
from sparsecore.stacking import StackingPlan

BACKENDS = ("xla", "fbgemm", "tpu")


def make_backend(name: str, plan: StackingPlan, weights: Mapping[str, torch.Tensor] | None = None,
                 seed: int = 0, **options) -> Backend:
    """Build backend ``name`` for ``plan``; the heavy imports happen here, per backend."""
    if name == "xla":
        from sparsecore.backends.xla import XlaBackend
        return XlaBackend(plan, weights, seed, **options)
    if name == "fbgemm":
        from sparsecore.backends.fbgemm import FbgemmBackend
        return FbgemmBackend(plan, weights, seed, **options)
    if name == "tpu":
        from sparsecore.backends.tpu import TpuBackend
        return TpuBackend(plan, weights, seed, **options)
    raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
