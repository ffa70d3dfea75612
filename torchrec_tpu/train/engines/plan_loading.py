"""``--plan``: a planner plan (a JSON from ``torchrec-tpu plan``, or planned now) as the sparsecore
EBC's per-table sharding and the SparseCore layout of each rank's local stacks.

Plan device ``d`` is training rank ``d``, so the plan must have exactly one device per rank. Each
table's sharding becomes a :class:`TableSharding`: table-wise -> its device, column-wise -> the
devices of its column blocks in column order, row-wise (mod over SparseCores in the plan) -> id
mod world size over the ranks, data-parallel -> a replica per rank. ``auto`` plans the model's
tables on a v5p line of ``world_size`` chips (one device per rank) for the global batch size.
A rank's local stacks are laid out for its device of the plan's slice (a v6e plan: 2 SparseCores,
v5p: 4, tpu7x: one chiplet of 2); without a plan, for one v5p chip per rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from torchrec_tpu.planner.plan import Plan, TablePlan
from torchrec_tpu.sharding.shards import SHARDING_TYPES, TableSharding, balanced_table_wise, make_shards
from torchrec_tpu.train.plan_file import PlanLoadError, check_plan_world, read_plan

AUTO = "auto"


@dataclass(frozen=True)
class Placement:
    """Where the tables go: each table's sharding over the ranks, and the SparseCores of one rank."""

    sharding: dict[str, TableSharding]
    rank_topology: SparseCoreTopology


def resolve_sharding(plan: str | None, tables: Sequence[TableSpec], features: Sequence[FeatureSpec],
                     world_size: int, global_batch: int) -> Placement:
    """The placement ``--plan`` asks for: None -> tables balanced table-wise over the ranks,
    ``auto`` -> planned now (for ``tables`` looked up by ``features``), else the plan JSON at that path."""
    if plan is None:
        return Placement(balanced_table_wise(tables, world_size), SparseCoreTopology())
    source = f"--plan={plan!r}"
    loaded = plan_for_world(tables, features, world_size, global_batch) if plan == AUTO else read_plan(plan)
    sharding = sharding_from_plan(loaded, tables, world_size, source)
    return Placement(sharding, SparseCoreTopology.for_rank(loaded.topology, world_size))


def rank_sparsecores(plan: str | None, world_size: int) -> int:
    """The SparseCores of one rank's device under ``--plan`` (:func:`resolve_sharding`'s
    ``rank_topology``), known before the tables are built."""
    if plan is None or plan == AUTO:
        return SparseCoreTopology().num_sparsecores
    return SparseCoreTopology.for_rank(read_plan(plan).topology, world_size).num_sparsecores


def plan_for_world(tables: Sequence[TableSpec], features: Sequence[FeatureSpec], world_size: int,
                   global_batch: int) -> Plan:
    """Plan ``tables`` for ``world_size`` ranks (a v5p 1x1xW line: one device per rank); ``features``
    say how many features look each table up (its lookups per sample) and their valency."""
    from torchrec_tpu.planner.id_limits import auto_id_limits, with_id_limits
    from torchrec_tpu.planner.options import IdLimitError
    from torchrec_tpu.planner.partitioner import PlanningError, plan_tables
    from torchrec_tpu.planner.tables import tables_from_sparsecore_specs
    from torchrec_tpu.topology import parse_accelerator_type

    try:
        topology = parse_accelerator_type(f"v5p-1x1x{world_size}")
        # the specs' limits are the library default (train has no flag for them): per table from
        # its pooling factor and the batch instead, as `torchrec-tpu plan` sets them
        planned = [replace(t, max_ids_per_partition=None) for t in tables_from_sparsecore_specs(tables, features)]
        planned = with_id_limits(planned, auto_id_limits(planned, topology, global_batch))
        return plan_tables(planned, topology, global_batch)
    except IdLimitError as err:  # in train's flags: the planner's own are plan's
        raise PlanLoadError(f"--plan=auto on {world_size} rank(s): {err.problem}; lower --batch-size (now "
                            f"{global_batch}) or train on more ranks (torchrun --nproc-per-node)") from None
    except (PlanningError, ValueError) as err:
        raise PlanLoadError(f"--plan=auto on {world_size} rank(s): {err}") from None


def sharding_from_plan(plan: Plan, tables: Sequence[TableSpec], world_size: int,
                       source: str = "plan") -> dict[str, TableSharding]:
    """Each table's :class:`TableSharding` from ``plan`` (device d = rank d), checked against the
    model's ``tables`` and the world; PlanLoadError names the table and the value."""
    check_plan_world(plan, world_size, source)
    planned = {t.name: t for t in plan.tables}
    model = {t.name: t for t in tables}
    unknown, missing = sorted(set(planned) - set(model)), sorted(set(model) - set(planned))
    if unknown:
        raise PlanLoadError(f"{source} names tables the model does not have: {unknown}; "
                            f"the model's tables: {sorted(model)}")
    if missing:
        raise PlanLoadError(f"{source} lacks the model's tables {missing}")
    sharding = {}
    for name, spec in model.items():
        where = f"{source}: table {name!r}"
        table = planned[name]
        for what, in_plan, in_model in (("rows", table.rows, spec.vocab_size), ("dim", table.dim, spec.dim)):
            if in_plan != in_model:
                raise PlanLoadError(f"{where} has {what}={in_plan} but the model's table has {what}={in_model}")
        sharding[name] = _table_sharding(table, world_size, where)
    other_optimizer = sorted(n for n, spec in model.items() if planned[n].optimizer != spec.optimizer.name)
    if other_optimizer:  # the sharding still runs; only the plan's memory and time estimates are off
        first = other_optimizer[0]
        warnings.warn(f"{source}: tables {other_optimizer} were planned for optimizer "
                      f"{planned[first].optimizer!r} but train with {model[first].optimizer.name!r}; the plan's "
                      "memory and step-time estimates assume the planned one", stacklevel=2)
    try:
        make_shards(tables, sharding, world_size)
    except ValueError as err:
        raise PlanLoadError(f"{source}: {err}") from None
    return sharding


def _table_sharding(table: TablePlan, world_size: int, where: str) -> TableSharding:
    kind = table.sharding_type
    if kind not in SHARDING_TYPES:
        raise PlanLoadError(f"{where}: sharding type {kind!r} is not supported; supported: {list(SHARDING_TYPES)}")
    if kind in ("row_wise", "data_parallel"):
        return TableSharding(kind)
    blocks = sorted(table.shards, key=lambda s: s.column_offset)
    devices = tuple(s.device for s in blocks)
    for device in devices:
        if device is None or not 0 <= device < world_size:
            raise PlanLoadError(f"{where} ({kind}): shard on device {device}, not a rank of the world of {world_size}")
    if kind == "table_wise" and len(devices) != 1:
        raise PlanLoadError(f"{where} (table_wise): needs exactly one shard, the plan has {len(devices)}")
    if kind == "column_wise":
        widths = [s.real_columns(table.dim) for s in blocks]
        if len(set(widths)) != 1:
            raise PlanLoadError(f"{where} (column_wise): column blocks of {widths} real columns; the sparsecore "
                                f"EBC needs equal blocks (dim {table.dim} in {len(widths)} parts)")
    return TableSharding(kind, devices)
