"""Table and feature stacking: group compatible tables into one mod-sharded stacked table.

Tables with equal padded dim, optimizer and combiner share a stack (jax-tpu-embedding's rule).
Each table's vocab is padded to a multiple of 8 x (total SparseCores) and its dim to a multiple
of 8; inside the stack, logical row r of a table lives on SparseCore ``(r % N + rotation) % N``
at shard row ``r // N + row_offset_in_shard``. The physical layout of a stacked table is
``[N * shard_rows, dim]``, SparseCore-major: physical row = sc * shard_rows + shard_row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from sparsecore.limits import ProposedLimits
from sparsecore.optimizers import OptimizerSpec
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec, validate_specs
from tpu_facts import ALIGNMENT, DEFAULT_MAX_IDS_PER_PARTITION, round_up

DEFAULT_ACTIVATION_BYTES_LIMIT = 2 * 1024 * 1024  # per SparseCore, as jax-tpu-embedding
# (stack name, the stack's total sample count) -> a partition limit (jax-tpu-embedding's LimitsCallable)
LimitsCallable = Callable[[str, int], int]


class BatchSizeError(ValueError):
    """A batch size that does not split evenly over the SparseCores."""


def default_stack_limit(stack_name: str, sample_count: int) -> int:
    """jax-tpu-embedding's ``get_default_limits``: 256 for every multi-table stack."""
    del stack_name, sample_count
    return DEFAULT_MAX_IDS_PER_PARTITION


@dataclass(frozen=True)
class TablePlacement:
    """Where one logical table sits inside its stack."""

    table: str
    vocab_size: int
    dim: int
    padded_vocab_size: int
    row_offset_in_shard: int
    shard_rotation: int


@dataclass(frozen=True)
class FeaturePlacement:
    """How a feature's ids and samples map into its stack (jax-tpu-embedding's id transformation):
    its ``samples`` rows of the stack's concatenated batch start at ``sample_offset``."""

    feature: str
    table: str
    samples: int  # the feature's batch in this plan (FeatureSpec.batch_size)
    sample_offset: int  # first row of this feature in the stack's concatenated batch
    col_offset: int  # row_offset_in_shard * N
    col_shift: int  # the table's shard rotation


@dataclass(frozen=True)
class StackedTable:
    """One stacked, mod-sharded table and the tables/features it serves."""

    name: str
    dim: int
    optimizer: OptimizerSpec
    combiner: str
    num_sparsecores: int
    tables: tuple[TablePlacement, ...]
    features: tuple[FeaturePlacement, ...]
    max_ids_per_partition: int
    max_unique_ids_per_partition: int

    @property
    def vocab_size(self) -> int:
        return sum(t.padded_vocab_size for t in self.tables)

    @property
    def shard_rows(self) -> int:
        return self.vocab_size // self.num_sparsecores

    @property
    def total_sample_count(self) -> int:
        return sum(f.samples for f in self.features)

    def table(self, name: str) -> TablePlacement:
        for placement in self.tables:
            if placement.table == name:
                return placement
        raise KeyError(f"table {name!r} is not in stack {self.name!r}")

    def physical_rows(self, table: str, logical_ids: np.ndarray) -> np.ndarray:
        """Physical rows in the stacked layout of a table's logical row ids."""
        placement = self.table(table)
        n = self.num_sparsecores
        ids = np.asarray(logical_ids, dtype=np.int64)
        sc = (ids % n + placement.shard_rotation) % n
        return sc * self.shard_rows + ids // n + placement.row_offset_in_shard

    def row_dims(self) -> np.ndarray:
        """Logical dim of the table owning each physical row (0 on pure padding rows)."""
        dims = np.zeros(self.vocab_size, dtype=np.int64)
        for placement in self.tables:
            rows = self.physical_rows(placement.table, np.arange(placement.padded_vocab_size))
            dims[rows] = placement.dim
        return dims


@dataclass(frozen=True)
class StackingPlan:
    """The stacks for one model on one topology; the input to preprocessing and every backend."""

    topology: SparseCoreTopology
    tables: Mapping[str, TableSpec]
    features: tuple[FeatureSpec, ...]
    stacks: tuple[StackedTable, ...]

    def with_limits(self, limits: Mapping[str, ProposedLimits]) -> StackingPlan:
        """This plan with new partition limits for the named stacks (e.g. ``FdoRecorder.propose``)."""
        unknown = sorted(set(limits) - {s.name for s in self.stacks})
        if unknown:
            raise KeyError(f"limits for unknown stacks {unknown}; stacks: {[s.name for s in self.stacks]}")
        stacks = tuple(
            replace(s, max_ids_per_partition=limits[s.name].max_ids_per_partition,
                    max_unique_ids_per_partition=limits[s.name].max_unique_ids_per_partition)
            if s.name in limits else s
            for s in self.stacks
        )
        return replace(self, stacks=stacks)

    def with_table_limits(self) -> StackingPlan:
        """This plan with every multi-table stack limited by the sum of its tables' own limits
        (a partition may carry the ids of all of them) instead of the per-stack limit."""
        return self.with_limits({
            s.name: ProposedLimits(
                sum(self.tables[t.table].max_ids_per_partition for t in s.tables),
                sum(self.tables[t.table].max_unique_ids_per_partition for t in s.tables), 0)
            for s in self.stacks if len(s.tables) > 1
        })

    def for_local_devices(self, local_devices: int) -> StackingPlan:
        """The plan a process driving ``local_devices`` of this topology's devices preprocesses
        its share of the batch with (jax-tpu-embedding's ``local_device_count``): the same stacks,
        ids still spread over all N SparseCores, every feature's batch and sample offset scaled
        by ``local_devices / num_devices`` (each SparseCore keeps its share of samples)."""
        total = self.topology.num_devices
        if not isinstance(local_devices, int) or not 1 <= local_devices <= total:
            raise ValueError(f"local_devices must be an int in [1, {total}], got {local_devices!r}")
        if local_devices == total:
            return self
        per_chip = self.topology.chip.devices_per_chip
        local = SparseCoreTopology(self.topology.generation, -(-local_devices // per_chip), local_devices)

        def share(samples: int) -> int:
            return samples * local_devices // total

        stacks = tuple(replace(s, features=tuple(
            replace(fp, samples=share(fp.samples), sample_offset=share(fp.sample_offset))
            for fp in s.features)) for s in self.stacks)
        features = tuple(replace(f, batch_size=share(f.batch_size)) for f in self.features)
        return replace(self, topology=local, features=features, stacks=stacks)

    def stack(self, name: str) -> StackedTable:
        for stack in self.stacks:
            if stack.name == name:
                return stack
        raise KeyError(f"unknown stack {name!r}; stacks: {[s.name for s in self.stacks]}")

    def stack_of_table(self, table: str) -> tuple[int, StackedTable]:
        """(index, stack) of the stack holding ``table``."""
        for i, stack in enumerate(self.stacks):
            if any(t.table == table for t in stack.tables):
                return i, stack
        raise KeyError(f"unknown table {table!r}; tables: {sorted(self.tables)}")


def stack_name(table_names: Sequence[str], max_length: int = 50) -> str:
    """Stack name: table names joined by '_', shortened with a hash when long."""
    name = "_".join(table_names)
    if len(name) <= max_length:
        return name
    return name[:max_length] + "..." + hashlib.sha256(name.encode()).hexdigest()[:12]


def plan_stacking(
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    topology: SparseCoreTopology,
    *,
    stack_tables: bool = True,
    rotation: int | None = None,
    activation_bytes_limit: int = DEFAULT_ACTIVATION_BYTES_LIMIT,
    stack_to_max_ids_per_partition: LimitsCallable = default_stack_limit,
    stack_to_max_unique_ids_per_partition: LimitsCallable = default_stack_limit,
    groups: Mapping[str, Sequence[str]] | None = None,
) -> StackingPlan:
    """Group tables into stacks and place every table and feature exactly as jax-tpu-embedding's
    ``auto_stack_tables`` does, whatever order ``tables`` and ``features`` come in.

    That layout is by name: features in name order (the leaf order of jax-tpu-embedding's feature
    dict) give every stack its feature order and sample offsets, and stacks and tables come in the
    order their first feature appears there; tables group by (padded dim, optimizer, combiner), each
    group split first fit where the pooled activations per SparseCore would exceed
    ``activation_bytes_limit``.
    A one-table stack keeps its table's partition limits; a multi-table stack gets
    ``stack_to_max_(unique_)ids_per_partition(stack name, its sample count)`` (default 256, as
    jax-tpu-embedding; ``StackingPlan.with_table_limits`` sums its tables' limits instead).
    ``rotation`` is the shard rotation between consecutive tables of a stack (default: the
    SparseCores per device). ``stack_tables=False`` keeps one table per stack (features of one
    table still stack). ``groups`` names stacks explicitly (stack name -> its tables, in row
    order; the tables must share padded dim, optimizer and combiner); the other tables group as
    above. ``StackingPlan.features`` keeps the given order.
    """
    by_name = validate_specs(tables, features)
    n = topology.num_sparsecores
    rotation = topology.sparsecores_per_device if rotation is None else rotation
    for feature in features:
        if feature.batch_size % n:
            raise BatchSizeError(
                f"feature {feature.name!r}: batch_size {feature.batch_size} is not divisible by the "
                f"{n} SparseCores of {topology.num_devices} {topology.generation} devices"
            )
    by_feature_name = sorted(features, key=lambda f: f.name)
    ordered_tables = [by_name[name] for name in dict.fromkeys(f.table for f in by_feature_name)]
    named = _explicit_groups(groups or {}, by_name)
    in_named = {t.name for group in named.values() for t in group}
    rest = [t for t in ordered_tables if t.name not in in_named]
    grouped = [(None, group) for group in _group_tables(rest, by_feature_name, n, stack_tables,
                                                       activation_bytes_limit)]
    grouped += list(named.items())
    first_seen = {t.name: i for i, t in enumerate(ordered_tables)}
    grouped.sort(key=lambda item: min(first_seen[t.name] for t in item[1]))
    limits = (stack_to_max_ids_per_partition, stack_to_max_unique_ids_per_partition)
    stacks = tuple(_build_stack(group, by_feature_name, n, rotation, limits, name) for name, group in grouped)
    return StackingPlan(topology, dict(by_name), tuple(features), stacks)


def _explicit_groups(groups: Mapping[str, Sequence[str]], by_name: Mapping[str, TableSpec]
                     ) -> dict[str, list[TableSpec]]:
    """The explicitly named stacks' tables, checked: known, in one stack each, stackable together."""
    out: dict[str, list[TableSpec]] = {}
    owner: dict[str, str] = {}
    for stack, names in groups.items():
        if not names:
            raise ValueError(f"stack {stack!r} names no tables")
        for name in names:
            if name not in by_name:
                raise ValueError(f"stack {stack!r} names unknown table {name!r}; known tables: {sorted(by_name)}")
            if name in owner:
                raise ValueError(f"table {name!r} is in two stacks, {owner[name]!r} and {stack!r}")
            owner[name] = stack
        tables = [by_name[name] for name in names]
        first = tables[0]
        for table in tables[1:]:
            for what, mine, theirs in (("padded dim", round_up(table.dim, ALIGNMENT), round_up(first.dim, ALIGNMENT)),
                                       ("optimizer", table.optimizer, first.optimizer),
                                       ("combiner", table.combiner, first.combiner)):
                if mine != theirs:
                    raise ValueError(f"stack {stack!r}: table {table.name!r} has {what} {mine!r} but table "
                                     f"{first.name!r} has {theirs!r}; stacked tables must agree")
        out[stack] = tables
    return out


def _group_tables(
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    n: int,
    stack_tables: bool,
    activation_bytes_limit: int,
) -> list[list[TableSpec]]:
    if not stack_tables:
        return [[t] for t in tables]
    by_key: dict[tuple, list[TableSpec]] = {}
    for table in tables:
        key = (round_up(table.dim, ALIGNMENT), table.optimizer, table.combiner)
        by_key.setdefault(key, []).append(table)
    samples = {t.name: 0 for t in tables}
    for feature in features:
        samples[feature.table] += feature.batch_size // n
    act_bytes = {t.name: round_up(t.dim, ALIGNMENT) * samples[t.name] * 4 for t in tables}
    groups: list[list[TableSpec]] = []
    for group in by_key.values():
        split: list[list[TableSpec]] = []
        for table in group:
            for candidate in split:
                if sum(act_bytes[t.name] for t in candidate) + act_bytes[table.name] <= activation_bytes_limit:
                    candidate.append(table)
                    break
            else:
                split.append([table])
        groups.extend(split)
    # stacks in the order their first feature appears (a group's first table is its earliest)
    first_seen = {t.name: i for i, t in enumerate(tables)}
    return sorted(groups, key=lambda group: first_seen[group[0].name])


def _build_stack(group: list[TableSpec], features: Sequence[FeatureSpec], n: int, rotation: int,
                 limits: tuple[LimitsCallable, LimitsCallable], name: str | None = None) -> StackedTable:
    dim = round_up(max(t.dim for t in group), ALIGNMENT)
    placements = []
    row_offset = shard_rotation = 0
    for table in group:
        padded = round_up(table.vocab_size, ALIGNMENT * n)
        placements.append(TablePlacement(table.name, table.vocab_size, table.dim, padded, row_offset, shard_rotation))
        row_offset += padded // n
        shard_rotation = (shard_rotation + rotation) % n
    by_table = {p.table: p for p in placements}
    feature_placements = []
    sample_offset = 0
    for feature in features:
        if feature.table in by_table:
            p = by_table[feature.table]
            feature_placements.append(
                FeaturePlacement(feature.name, feature.table, feature.batch_size, sample_offset,
                                 p.row_offset_in_shard * n, p.shard_rotation)
            )
            sample_offset += feature.batch_size
    name = name or stack_name([t.name for t in group])
    if len(group) == 1:
        max_ids, max_unique = group[0].max_ids_per_partition, group[0].max_unique_ids_per_partition
    else:
        max_ids, max_unique = (limit(name, sample_offset) for limit in limits)
    return StackedTable(
        name=name, dim=dim, optimizer=group[0].optimizer,
        combiner=group[0].combiner, num_sparsecores=n, tables=tuple(placements),
        features=tuple(feature_placements), max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_unique,
    )


def stack_rows(stack: StackedTable, per_table: Mapping[str, torch.Tensor], fill: float = 0.0) -> torch.Tensor:
    """Lay per-table tensors ([vocab, dim] weights or [vocab] row slots) out as the stack.

    Padding rows and padding columns get ``fill``.
    """
    missing = sorted({p.table for p in stack.tables} - set(per_table))
    if missing:
        raise KeyError(f"stack {stack.name!r} needs tensors for tables {missing}")
    first = per_table[stack.tables[0].table]
    trailing = (stack.dim,) if first.dim() == 2 else ()
    out = torch.full((stack.vocab_size, *trailing), fill, dtype=first.dtype)
    for placement in stack.tables:
        values = per_table[placement.table]
        expected = (placement.vocab_size, placement.dim)[: values.dim()]
        if tuple(values.shape) != expected:
            raise ValueError(
                f"table {placement.table!r}: expected a tensor of shape {expected}, got {tuple(values.shape)}"
            )
        rows = torch.from_numpy(stack.physical_rows(placement.table, np.arange(placement.vocab_size)))
        if trailing:
            out[rows, : placement.dim] = values
        else:
            out[rows] = values
    return out


def unstack_rows(stack: StackedTable, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inverse of ``stack_rows``: per-table tensors cut back to their logical vocab and dim."""
    if stacked.shape[0] != stack.vocab_size:
        raise ValueError(f"stack {stack.name!r} has {stack.vocab_size} rows, got {stacked.shape[0]}")
    out = {}
    for placement in stack.tables:
        rows = torch.from_numpy(stack.physical_rows(placement.table, np.arange(placement.vocab_size)))
        values = stacked[rows]
        out[placement.table] = values[:, : placement.dim].clone() if stacked.dim() == 2 else values.clone()
    return out
