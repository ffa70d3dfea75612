"""A plan read from a file, checked against its own slice before anything trusts it: every table's
shards cover its padded columns exactly and its rows, sit on devices the slice has, and the
device list is the slice's. A hand-edited field fails with the table, the field and the value."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrec_tpu.structured_files import brief
from tpu_facts import ALIGNMENT, ShardingKind, round_up

if TYPE_CHECKING:
    from torchrec_tpu.planner.plan import Plan, TablePlan

PLACED = (ShardingKind.TABLE_WISE, ShardingKind.COLUMN_WISE)  # one device per shard
EVERYWHERE = (ShardingKind.ROW_WISE, ShardingKind.DATA_PARALLEL)  # one shard, on every device


def check_plan(plan: Plan) -> None:
    """ValueError naming the first table and field of ``plan`` that its slice contradicts."""
    topology = plan.topology
    devices = [d.device for d in plan.devices]
    if devices != list(range(topology.num_devices)):
        raise ValueError(f"devices {devices} are not the {topology.num_devices} devices of {topology.name} "
                         f"(0..{topology.num_devices - 1})")
    for table in plan.tables:
        _check_table(table, topology.num_devices, topology.num_sparsecores, topology.sparsecores_per_device)


def _check_table(table: TablePlan, num_devices: int, sparsecores: int, sparsecores_per_device: int) -> None:
    where = f"table {brief(table.name)}"
    for field in ("rows", "dim"):
        value = getattr(table, field)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {field}={brief(value)}, expected a whole number > 0")
    padded = round_up(table.dim, ALIGNMENT)
    if table.padded_dim != padded:
        raise ValueError(f"{where}: padded_dim={brief(table.padded_dim)}, expected {padded} (dim {table.dim} "
                         f"rounded up to {ALIGNMENT})")
    kind = table.sharding_type
    if kind not in list(ShardingKind):
        raise ValueError(f"{where}: sharding_type={brief(kind)}, expected one of {[k.value for k in ShardingKind]}")
    if not table.shards or (kind != "column_wise" and len(table.shards) != 1):
        raise ValueError(f"{where} ({kind}): {len(table.shards)} shards, expected "
                         f"{'at least one' if kind == 'column_wise' else 'one'}")
    offset = 0
    for i, shard in enumerate(sorted(table.shards, key=lambda s: s.column_offset)):
        at = f"{where} ({kind}) shard {i}"
        if kind in PLACED and not (isinstance(shard.device, int) and 0 <= shard.device < num_devices):
            raise ValueError(f"{at}: device={brief(shard.device)}, expected a device of the slice "
                             f"(0..{num_devices - 1})")
        if kind in EVERYWHERE and shard.device is not None:
            raise ValueError(f"{at}: device={brief(shard.device)}, expected null ({kind} tables are on every device)")
        if shard.column_offset != offset:
            raise ValueError(f"{at}: column_offset={brief(shard.column_offset)}, expected {offset} (the shards' "
                             f"columns must cover 0..{padded} without gaps or overlaps)")
        if not isinstance(shard.columns, int) or shard.columns < ALIGNMENT or shard.columns % ALIGNMENT \
                or offset >= table.dim:
            raise ValueError(f"{at}: columns={brief(shard.columns)}, expected a multiple of {ALIGNMENT} holding real "
                             f"columns of the {table.dim}")
        offset += shard.columns
        rows_needed = -(-table.rows // num_devices) if kind == "row_wise" else table.rows
        most = round_up(table.rows, ALIGNMENT * (sparsecores if kind == "row_wise" else sparsecores_per_device))
        most //= num_devices if kind == "row_wise" else 1
        if not isinstance(shard.rows, int) or not rows_needed <= shard.rows <= most:
            raise ValueError(f"{at}: rows={brief(shard.rows)}, expected {rows_needed}..{most} for the table's "
                             f"{table.rows} rows")
    if offset != padded:
        raise ValueError(f"{where} ({kind}): the shards' columns end at {offset}, expected {padded}")
