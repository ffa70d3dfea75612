"""Optimizer specs for SparseCore tables: hyperparameters and slot layout (no math here).

The update formulas follow jax-tpu-embedding 0.1.0's SparseCore kernels; the per-backend
implementations live in ``sparsecore.backends``. Every optimizer is applied once per touched row
with the gradient accumulated over all occurrences of that row in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

from tpu_facts import OPTIMIZER_SLOTS


def _slot_names(name: str) -> tuple[str, ...]:
    """Every slot table of optimizer ``name`` (``tpu_facts.OPTIMIZER_SLOTS``)."""
    element, row = OPTIMIZER_SLOTS[name]
    return element + row


def _row_slots(name: str) -> frozenset[str]:
    """The slot tables of optimizer ``name`` that hold one value per row."""
    return frozenset(OPTIMIZER_SLOTS[name][1])


@dataclass(frozen=True)
class OptimizerSpec:
    """Base class: ``learning_rate`` plus the names and initial values of the slot tables."""

    learning_rate: float = 0.01

    name: ClassVar[str] = ""
    # Slot tables the optimizer keeps next to the weights; "row" slots hold one value per row
    # (each subclass's from tpu_facts.OPTIMIZER_SLOTS under its ``name``).
    slot_names: ClassVar[tuple[str, ...]] = ()
    row_slots: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{type(self).__name__}.{f.name} must be finite, got {value}")
        if self.learning_rate <= 0:
            raise ValueError(
                f"{type(self).__name__}.learning_rate must be > 0, got {self.learning_rate}"
            )

    def slot_initial_values(self) -> dict[str, float]:
        """Initial value of every slot table, by slot name."""
        return {}

    def hyperparameters(self) -> dict[str, float]:
        """All hyperparameters by field name (used for grouping and serialisation)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class SGD(OptimizerSpec):
    """w -= lr * g."""

    name: ClassVar[str] = "sgd"


@dataclass(frozen=True)
class Adagrad(OptimizerSpec):
    """acc += g^2; w -= lr * g / (sqrt(acc) + eps)   (element-wise accumulator)."""

    initial_accumulator_value: float = 0.1
    eps: float = 0.0

    name: ClassVar[str] = "adagrad"
    slot_names: ClassVar[tuple[str, ...]] = _slot_names("adagrad")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.initial_accumulator_value < 0 or self.eps < 0:
            raise ValueError("Adagrad initial_accumulator_value and eps must be >= 0")
        if self.initial_accumulator_value == 0 and self.eps == 0:
            raise ValueError("Adagrad needs initial_accumulator_value > 0 or eps > 0 (0/0 otherwise)")

    def slot_initial_values(self) -> dict[str, float]:
        return {"accumulator": self.initial_accumulator_value}


@dataclass(frozen=True)
class RowWiseAdagrad(Adagrad):
    """acc_row += mean_d(g^2) over the table's logical dim; w -= lr * g / (sqrt(acc_row) + eps)."""

    name: ClassVar[str] = "rowwise_adagrad"
    slot_names: ClassVar[tuple[str, ...]] = _slot_names("rowwise_adagrad")
    row_slots: ClassVar[frozenset[str]] = _row_slots("rowwise_adagrad")


@dataclass(frozen=True)
class Adam(OptimizerSpec):
    """Lazy Adam: only touched rows update m, v; bias correction uses the table's step count t.

    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
    w -= lr * sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps * sqrt(1-b2^t)).
    """

    learning_rate: float = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-8

    name: ClassVar[str] = "adam"
    slot_names: ClassVar[tuple[str, ...]] = _slot_names("adam")

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("beta_1", "beta_2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"Adam.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.epsilon <= 0:
            raise ValueError(f"Adam.epsilon must be > 0, got {self.epsilon}")

    def slot_initial_values(self) -> dict[str, float]:
        return {"momentum": 0.0, "velocity": 0.0}


@dataclass(frozen=True)
class FTRL(OptimizerSpec):
    """FTRL-proximal (learning_rate_power k, l1, l2, beta), as in jax-tpu-embedding.

    acc' = acc + g^2;  dp = acc'^-k - acc^-k;  lin' = lin + g - dp / lr * w;
    w' = (-lin' if l1 == 0 else clip(lin', -l1, l1) - lin') / ((acc'^-k + beta) / lr + 2 l2).
    """

    learning_rate_power: float = -0.5
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1
    initial_linear_value: float = 0.0

    name: ClassVar[str] = "ftrl"
    slot_names: ClassVar[tuple[str, ...]] = _slot_names("ftrl")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.learning_rate_power > 0:
            raise ValueError(f"FTRL.learning_rate_power must be <= 0, got {self.learning_rate_power}")
        if self.l1_regularization_strength < 0 or self.l2_regularization_strength < 0:
            raise ValueError("FTRL l1/l2 regularization strengths must be >= 0")
        if self.initial_accumulator_value <= 0:
            raise ValueError("FTRL.initial_accumulator_value must be > 0")

    def slot_initial_values(self) -> dict[str, float]:
        return {"accumulator": self.initial_accumulator_value, "linear": self.initial_linear_value}


OPTIMIZERS: dict[str, type[OptimizerSpec]] = {
    cls.name: cls for cls in (SGD, Adagrad, RowWiseAdagrad, Adam, FTRL)
}
