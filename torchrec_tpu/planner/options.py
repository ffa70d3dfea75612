"""The planner's cost side: every table's feasible sharding options on a topology.

:class:`TableOptions` asks the cost model (``cost_model.OptionBuilder``) for each table's options,
keeps those the user's constraints allow, within the id limit and fitting one device's HBM, and
answers the memory questions the search and the plan assembly ask of an option.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torchrec_tpu.planner.cost_model import OptionBuilder, ShardingOption
from torchrec_tpu.planner.tables import EmbeddingTable
from torchrec_tpu.topology import TPUTopology
from tpu_facts import DEFAULT_MAX_IDS_PER_PARTITION, GIB, MAX_IDS_PER_PARTITION_CEILING, ShardingKind


class PlanningError(ValueError):
    """The tables cannot be planned on this topology (names the table and the shortfall)."""


class IdLimitError(PlanningError):
    """Every sharding of a table that fits in HBM sends a SparseCore partition more ids per step
    than the id limit. ``problem`` says so; the message adds ``fix``, the flags of ``plan`` by
    default (``train --plan auto`` words it in its own flags). ``needed``: the smallest limit
    that would do."""

    def __init__(self, problem: str, needed: int, fix: str | None = None) -> None:
        self.problem, self.needed = problem, needed
        if fix is None:
            fix = "lower --batch-size or use more chips"
            if needed <= MAX_IDS_PER_PARTITION_CEILING:
                fix = (f"raise --max-ids-per-partition (or the table's max_ids_per_partition) to >= {needed}, "
                       + fix)
        super().__init__(f"{problem}; {fix}")


def allowed_kinds(constraints: Mapping[str, Any] | None, table: str) -> set[ShardingKind] | None:
    """Sharding kinds a constraint allows: a TorchRec ``ParameterConstraints`` (its
    ``sharding_types``) or a plain list of names; None = no constraint."""
    if not constraints or table not in constraints:
        return None
    raw = constraints[table]
    names = getattr(raw, "sharding_types", raw)
    if names is None:
        return None
    known = {k.value: k for k in ShardingKind}
    kinds = {known[n] for n in names if n in known}
    if not kinds:
        raise PlanningError(f"table {table!r}: constraint allows {list(names)}, none of which the TPU "
                            f"planner supports ({sorted(known)})")
    return kinds


class TableOptions:
    """Sharding options of tables on ``topology`` for a global ``batch_size``, under the id limit
    ``max_ids_per_partition`` (a table's own takes precedence) and ``constraints``."""

    def __init__(self, topology: TPUTopology, batch_size: int,
                 max_ids_per_partition: int = DEFAULT_MAX_IDS_PER_PARTITION,
                 constraints: Mapping[str, Any] | None = None) -> None:
        self.topology = topology
        self.builder = OptionBuilder(topology, batch_size, max_ids_per_partition)
        self.constraints = constraints
        self.d = topology.num_devices
        self.usable = float(topology.usable_hbm_bytes_per_device)
        self.over_limit: dict[str, list[ShardingOption]] = {}  # options the id limit ruled out, by table

    def feasible(self, table: EmbeddingTable) -> list[ShardingOption]:
        """Options of ``table`` within the id limit that fit one device's HBM (PlanningError if none)."""
        kinds = allowed_kinds(self.constraints, table.name)
        options = [o for o in self.builder.options(table) if kinds is None or o.kind in kinds]
        limit = self.id_limit(table)
        self.over_limit[table.name] = [o for o in options if o.ids_per_partition > limit]
        fitting = [o for o in options if o.ids_per_partition <= limit and self.fits_alone(o)]
        if fitting:
            return fitting
        lean = min(options, key=self.peak_memory)
        if self.fits_alone(lean):
            unlock = min((o for o in options if self.fits_alone(o)), key=lambda o: o.ids_per_partition)
            raise IdLimitError(
                f"table {table.name!r}: every sharding that fits in HBM exceeds the id limit; {unlock.kind.value} "
                f"needs {unlock.ids_per_partition:.0f} ids per SparseCore partition per step (id limit {limit})",
                math.ceil(unlock.ids_per_partition))
        need = self.peak_memory(lean)
        raise PlanningError(
            f"table {table.name!r} ({table.rows} rows x {table.dim}, {table.optimizer}) does not fit: it needs "
            f"at least {need / GIB:.2f} GiB on one device of {self.topology.name} even {lean.kind.value} "
            f"({self.topology.num_sparsecores} SparseCores in all), a device has {self.usable / GIB:.2f} GiB "
            f"usable; shortfall {(need - self.usable) / GIB:.2f} GiB"
        )

    def id_limit(self, table: EmbeddingTable) -> int:
        """The table's own ``max_ids_per_partition`` (e.g. from FDO), else the planner-wide one."""
        return table.max_ids_per_partition or self.builder.max_ids_per_partition

    def peak_memory(self, o: ShardingOption) -> float:
        """Memory on the device holding ``o``'s largest shard."""
        return o.uniform.memory_bytes + max((s.load.memory_bytes for s in o.shards), default=0.0)

    def mean_memory(self, o: ShardingOption) -> float:
        """Memory ``o`` costs the average device."""
        return o.uniform.memory_bytes + sum(s.load.memory_bytes for s in o.shards) / self.d

    def fits_alone(self, o: ShardingOption) -> bool:
        return self.peak_memory(o) <= self.usable
