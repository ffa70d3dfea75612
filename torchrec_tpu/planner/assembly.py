"""The planner's output side: a :class:`~torchrec_tpu.planner.plan.Plan` from the chosen options.

Given each table's option and the device of each of its shards, :func:`assemble_plan` sums every
device's load, groups the tables into SparseCore stacks (tables of one stack key, and device when
placed), adds the per-step overheads and lists the tables the id limit pushed onto a costlier
sharding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torchrec_tpu.planner.cost_model import ALL_TO_ALLS_PER_STEP, Load, ShardingOption
from torchrec_tpu.planner.options import TableOptions
from torchrec_tpu.planner.plan import DevicePlan, Plan, ShardPlacement, StackPlan, TablePlan
from torchrec_tpu.planner.tables import EmbeddingTable
from torchrec_tpu.zch_names import ZCH_SLOT_BYTES
from tpu_facts import ShardingKind


@dataclass
class Choice:
    """A table's option and the device of each of its shards."""

    option: ShardingOption
    devices: tuple[int, ...]  # one per shard


def assemble_plan(options: TableOptions, tables: Sequence[EmbeddingTable], choices: Mapping[str, Choice],
                  bound: float) -> Plan:
    """The plan of ``choices`` for ``tables``; ``bound``: the search's lower bound (bandwidth terms)."""
    topo, costs, d = options.topology, options.topology.costs, options.d
    stacks: dict[tuple[str, int | None], list[str]] = {}
    per_device = [Load() for _ in range(d)]
    placed_names: list[list[str]] = [[] for _ in range(d)]
    host = [0] * d  # managed-collision remaps: one per shard, over its rows
    uniform = Load()
    table_plans = []
    for t in tables:
        choice = choices[t.name]
        o = choice.option
        uniform = uniform + o.uniform
        # a remap per shard over the table's rows (row-wise: over the rank's share of them, unpadded)
        remap_bytes = (ZCH_SLOT_BYTES[t.zch] * (-(-t.rows // d) if o.kind is ShardingKind.ROW_WISE else t.rows)
                       if t.zch is not None else 0)
        if o.shards:
            shards = tuple(ShardPlacement(dev, s.column_offset, s.columns, s.rows)
                           for s, dev in zip(o.shards, choice.devices))
            for s, dev in zip(o.shards, choice.devices):
                per_device[dev] = per_device[dev] + s.load
                host[dev] += remap_bytes
                placed_names[dev].append(t.name)
                stacks.setdefault((o.stack_key, dev), []).append(t.name)
        else:
            shards = (ShardPlacement(None, 0, o.padded_dim, o.rows_per_device),)
            host = [h + remap_bytes for h in host]
            if o.kind is not ShardingKind.DATA_PARALLEL:
                stacks.setdefault((o.stack_key, None), []).append(t.name)
        hbm = o.uniform.hbm_bytes * d + sum(s.load.hbm_bytes for s in o.shards)
        table_plans.append(TablePlan(t.name, t.rows, t.dim, o.padded_dim, o.kind.value, t.optimizer, shards,
                                     _stack_name(o.stack_key, shards[0].device if o.shards else None),
                                     int(hbm), o.total_time_s(d), o.ids_per_partition, options.id_limit(t)))
    global_stacks = sum(1 for (_, dev) in stacks if dev is None)
    latency = costs.collective_latency_s * ALL_TO_ALLS_PER_STEP * (d > 1)
    devices = []
    for dev in range(d):
        load = per_device[dev] + uniform
        n_stacks = global_stacks + sum(1 for (_, s) in stacks if s == dev)
        devices.append(DevicePlan(dev, dev // topo.chip.devices_per_chip, int(load.hbm_bytes),
                                  int(load.buffer_bytes), load.lookup_s, load.comm_s,
                                  costs.kernel_overhead_s * n_stacks + latency, n_stacks,
                                  tuple(placed_names[dev]), int(load.input_bytes), int(load.output_bytes), host[dev]))
    stack_plans = tuple(StackPlan(_stack_name(key, dev), dev, tuple(names))
                        for (key, dev), names in sorted(stacks.items(), key=lambda kv: (_stack_name(*kv[0]))))
    return Plan(topo, options.builder.batch_size, options.builder.max_ids_per_partition,
                int(options.usable), tuple(table_plans), tuple(devices), stack_plans, bound + latency,
                _limit_warnings(options, tables, choices))


def _limit_warnings(options: TableOptions, tables: Sequence[EmbeddingTable],
                    choices: Mapping[str, Choice]) -> tuple[str, ...]:
    """Tables the id limit pushed onto a costlier sharding, with the limit that would free them."""
    d = options.d
    out = []
    for t in tables:
        chosen = choices[t.name].option
        limit = chosen.total_time_s(d)
        better = [o for o in options.over_limit.get(t.name, []) if o.total_time_s(d) < limit]
        if better:
            best = min(better, key=lambda o: (o.ids_per_partition, o.total_time_s(d)))  # smallest unlock
            out.append(
                f"table {t.name!r}: {best.kind.value} would need {best.ids_per_partition:.0f} ids per SparseCore "
                f"partition (limit {options.id_limit(t)}); planned {chosen.kind.value} instead at "
                f"{chosen.total_time_s(d) / best.total_time_s(d):.1f}x the work. Raise --max-ids-per-partition (or the "
                f"table's max_ids_per_partition) to >= {math.ceil(best.ids_per_partition)} to allow it"
            )
    return tuple(out)


def _stack_name(key: str, device: int | None) -> str:
    return key if device is None else f"{key}@{device}"
