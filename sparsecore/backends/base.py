"""The interface every lookup backend implements, and what they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from sparsecore.limits import StackStats
from sparsecore.specs import TableSpec
from sparsecore.stacking import StackingPlan
from sparsecore.validation import FeatureInput


class Backend(ABC):
    """Pooled lookups with a fused, in-place optimizer update in the backward pass.

    One family of verbs, on every backend, in three depths of the same step:

    - ``forward`` returns per-feature pooled activations [batch, table dim] plus an opaque context;
      ``backward`` takes the gradients of those activations and updates every touched row once;
    - ``prepare`` (host work ahead of the step, e.g. on a prefetch thread), ``compile``, ``lookup``
      (all features side by side) and ``update`` (its gradient): the same step, split for a pipeline.

    A step program that traces the lookup and update itself calls the tpu device's SparseCore ops
    (``torch.ops.tpu.sparse_dense_matmul*``) on tpu tables instead: ``torchrec_tpu.sharding.ops_backend``.
    """

    name: ClassVar[str]

    def __init__(self, plan: StackingPlan):
        self.plan = plan
        self.steps = 0
        # SparseCore partition stats of the last forward, by stack (for FdoRecorder); stays
        # empty on backends that do not build SparseCore input
        self.last_stats: dict[str, StackStats] = {}

    def _load_initial(self, weights: Mapping[str, torch.Tensor] | None, seed: int) -> None:
        """Load ``weights`` (default: each table's ``init_weights(seed)``) with fresh slots; a
        subclass calls it once its own buffers exist. Nothing keeps the given tensors alive."""
        if weights is None:
            weights = TableTensors({name: (spec.vocab_size, spec.dim) for name, spec in self.plan.tables.items()},
                                   lambda name: self.plan.tables[name].init_weights(seed))
        self.load_state(weights)

    def load_state(self, weights: Mapping[str, torch.Tensor],
                   slots: Mapping[str, Mapping[str, torch.Tensor]] | None = None, steps: int = 0) -> None:
        """Replace all weights (and slots, default: the optimizer's initial values) and the step
        count, e.g. from a checkpoint of ``table_weights`` / ``optimizer_slots`` / ``steps``."""
        slots = slots if slots is not None else initial_slots(self.plan)
        check_state(self.plan, weights, slots)
        self._load(weights, slots)
        self.steps = steps

    @abstractmethod
    def _load(self, weights: Mapping[str, torch.Tensor], slots: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Install checked weights and slots."""

    @abstractmethod
    def forward(self, inputs: Mapping[str, FeatureInput]) -> tuple[dict[str, torch.Tensor], Any]:
        """Per-feature pooled activations and the context ``backward`` needs."""

    @abstractmethod
    def backward(self, context: Any, grads: Mapping[str, torch.Tensor]) -> None:
        """Apply the fused optimizer update for the activation gradients ``grads``."""

    def set_partition_limits(self, limits: Mapping[str, tuple[int, int]]) -> None:
        """New (ids, unique ids) partition limits of the named stacks, for the batches prepared from
        now on (FDO). Only a backend whose programs do not depend on the limits takes them."""
        raise NotImplementedError(f"the {self.name} backend keeps the partition limits it was built with")

    def prepare(self, inputs: Mapping[str, FeatureInput]) -> Any:
        """Host-side work on a batch that can run ahead of its step (e.g. on a prefetch thread);
        ``lookup`` takes the result. Default: nothing to do ahead."""
        return inputs

    def compile(self, prepared: Any) -> None:
        """Compile the programs a batch like ``prepared`` needs, ahead of its step. Default: none."""
        return None

    def lookup(self, prepared: Any) -> tuple[torch.Tensor, Any]:
        """Activations of every feature side by side, [batch, sum of dims] in plan feature order
        (all features share one batch size), and the context ``update`` needs."""
        activations, context = self.forward(prepared)
        return torch.cat([activations[f.name] for f in self.plan.features], dim=1), context

    def update(self, context: Any, grad: torch.Tensor) -> None:
        """``backward`` for the gradient of ``lookup``'s output."""
        dims = [self.plan.tables[f.table].dim for f in self.plan.features]
        self.backward(context, dict(zip((f.name for f in self.plan.features), torch.split(grad, dims, dim=1))))

    @abstractmethod
    def table_weights(self) -> dict[str, torch.Tensor]:
        """Current [vocab, dim] weights of every logical table (copies)."""

    @abstractmethod
    def optimizer_slots(self) -> dict[str, dict[str, torch.Tensor]]:
        """Current optimizer slots by table and slot name ([vocab, dim], or [vocab] row slots)."""

    def reset_rows(self, table: str, rows: torch.Tensor, weights: torch.Tensor, slots: Mapping[str, float]) -> None:
        """Overwrite rows ``rows`` of ``table``: their weights with ``weights`` ([len(rows), dim])
        and each optimizer slot with its value in ``slots`` (a managed-collision eviction). Here: a
        reload of every table; a backend that writes rows where they are overrides it."""
        weights_now, slots_now = self.table_weights(), self.optimizer_slots()
        weights_now[table][rows] = weights
        for slot, value in slots.items():
            slots_now[table][slot][rows] = value
        self.load_state(weights_now, slots_now, self.steps)

    def table_value(self, table: str, slot: str | None = None) -> torch.Tensor:
        """One table's current weights (or its optimizer ``slot``), a new host tensor. Here: cut
        from :meth:`table_weights` / :meth:`optimizer_slots` (which copy every table); a backend
        that can read one table alone overrides it."""
        return self.table_weights()[table] if slot is None else self.optimizer_slots()[table][slot]


class ReadsTablesAlone(Backend):
    """A backend that reads one table alone (:meth:`table_value`): every table and slot comes
    from it, one at a time."""

    def table_weights(self) -> dict[str, torch.Tensor]:
        return {name: self.table_value(name) for name in self.plan.tables}

    def optimizer_slots(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: {slot: self.table_value(name, slot) for slot in spec.optimizer.slot_names}
                for name, spec in self.plan.tables.items()}

    @abstractmethod
    def table_value(self, table: str, slot: str | None = None) -> torch.Tensor:
        """One table's current weights (or its optimizer ``slot``), read alone: a new host tensor."""


class TableTensors(Mapping[str, Any]):
    """Per-table values made on access, by table name, none kept: a backend loading them one
    table at a time never holds all of them at once. ``shapes``: the tables, and the shape of each
    one's value where that is a tensor (what :func:`check_state` checks without making it);
    ``make(name)``: its value."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], make: Callable[[str], Any]) -> None:
        self.shapes = dict(shapes)
        self._make = make

    def __getitem__(self, name: str) -> Any:
        if name not in self.shapes:
            raise KeyError(name)
        return self._make(name)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def initial_slots(plan: StackingPlan) -> TableTensors:
    """Every table's slots filled with the optimizer's initial values (made per table on access)."""
    return TableTensors({name: () for name in plan.tables}, lambda name: initial_table_slots(plan.tables[name]))


def initial_table_slots(spec: TableSpec) -> dict[str, torch.Tensor]:
    """One table's slots filled with its optimizer's initial values."""
    return {slot: torch.full((spec.vocab_size,) if slot in spec.optimizer.row_slots else (spec.vocab_size, spec.dim),
                             value, dtype=torch.float32)
            for slot, value in spec.optimizer.slot_initial_values().items()}


def check_state(plan: StackingPlan, weights: Mapping[str, torch.Tensor],
                slots: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Weights and slots exist for every table with the table's shapes."""
    for name, spec in plan.tables.items():
        if name not in weights:
            raise KeyError(f"weights missing for table {name!r}")
        shape = weights.shapes[name] if isinstance(weights, TableTensors) else tuple(weights[name].shape)
        if shape != (spec.vocab_size, spec.dim):
            raise ValueError(f"table {name!r}: weights have shape {shape}, expected {(spec.vocab_size, spec.dim)}")
        if isinstance(slots, TableTensors):  # (made to the spec's shapes)
            continue
        for slot in spec.optimizer.slot_names:
            expected = (spec.vocab_size,) if slot in spec.optimizer.row_slots else (spec.vocab_size, spec.dim)
            got = slots.get(name, {}).get(slot)
            if got is None or tuple(got.shape) != expected:
                raise ValueError(f"table {name!r}: optimizer slot {slot!r} must have shape {expected}, got "
                                 f"{None if got is None else tuple(got.shape)}")


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
