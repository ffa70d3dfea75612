"""The interface every lookup backend implements, and what they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from sparsecore.limits import StackStats
from sparsecore.stacking import StackingPlan
from sparsecore.validation import FeatureInput


class Backend(ABC):
    """Pooled lookups with a fused, in-place optimizer update in the backward pass.

    ``forward`` returns per-feature pooled activations [batch, table dim] plus an opaque context;
    ``backward`` takes the gradients of those activations and updates every touched row once.
    """

    name: ClassVar[str]

    def __init__(self, plan: StackingPlan, weights: Mapping[str, torch.Tensor] | None = None, seed: int = 0):
        self.plan = plan
        self.steps = 0
        # SparseCore partition stats of the last forward, by stack (for FdoRecorder); stays
        # empty on backends that do not build SparseCore input
        self.last_stats: dict[str, StackStats] = {}
        if weights is None:
            weights = {name: spec.init_weights(seed) for name, spec in plan.tables.items()}
        for name, spec in plan.tables.items():
            if name not in weights:
                raise KeyError(f"initial weights missing for table {name!r}")
            if tuple(weights[name].shape) != (spec.vocab_size, spec.dim):
                raise ValueError(
                    f"table {name!r}: initial weights have shape {tuple(weights[name].shape)}, "
                    f"expected {(spec.vocab_size, spec.dim)}"
                )
        self._initial_weights = {k: v.detach().to(torch.float32) for k, v in weights.items()}

    @abstractmethod
    def forward(self, inputs: Mapping[str, FeatureInput]) -> tuple[dict[str, torch.Tensor], Any]:
        """Per-feature pooled activations and the context ``backward`` needs."""

    @abstractmethod
    def backward(self, context: Any, grads: Mapping[str, torch.Tensor]) -> None:
        """Apply the fused optimizer update for the activation gradients ``grads``."""

    @abstractmethod
    def table_weights(self) -> dict[str, torch.Tensor]:
        """Current [vocab, dim] weights of every logical table (copies)."""

    @abstractmethod
    def optimizer_slots(self) -> dict[str, dict[str, torch.Tensor]]:
        """Current optimizer slots by table and slot name ([vocab, dim], or [vocab] row slots)."""


def initial_slot(plan: StackingPlan, table: str, slot: str) -> torch.Tensor:
    """A table's slot filled with the optimizer's initial value."""
    spec = plan.tables[table]
    shape = (spec.vocab_size,) if slot in spec.optimizer.row_slots else (spec.vocab_size, spec.dim)
    return torch.full(shape, spec.optimizer.slot_initial_values()[slot], dtype=torch.float32)


def check_grads(plan: StackingPlan, grads: Mapping[str, torch.Tensor]) -> None:
    """Every feature has a gradient of its activation's shape."""
    for feature in plan.features:
        if feature.name not in grads:
            raise KeyError(f"no activation gradient for feature {feature.name!r}")
        expected = (feature.batch_size, plan.tables[feature.table].dim)
        if tuple(grads[feature.name].shape) != expected:
            raise ValueError(
                f"feature {feature.name!r}: gradient shape {tuple(grads[feature.name].shape)} != {expected}"
            )
