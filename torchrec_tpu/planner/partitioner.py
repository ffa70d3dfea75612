"""Fast TPU sharding search: pick a sharding per table, place shards, balance the slowest device.

TorchRec's greedy search re-proposes and re-partitions every table on every rank (minutes to
hours for 1000 tables, FIELD_NOTES); here each table is costed once per option and the search
is a longest-processing-time placement plus local moves, O(T * options * D):

1. Options per table (``cost_model.OptionBuilder``), filtered by user constraints, the id limit
   and memory. Row-wise / data-parallel options load every device equally ("uniform"); table-
   and column-wise shards load one device each ("placed").
2. Options are chosen against a fluid estimate of the step time (uniform load + the placed work
   spread evenly, but never less than the largest shard), then swapped for leaner ones if the
   average device would run out of HBM.
3. Shards are placed largest first on the least-loaded device with memory room (LPT).
4. Local moves: uniform tables that fit in the valleys of the placed load become placed; tables
   on the slowest device are moved or re-sharded while that lowers the slowest device's time.

Quality is reported against the lower bound max(sum_t min_option work(t) / D, max_t min_option
(uniform + largest shard)): perfect balance, or one table's unavoidable footprint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from pipelines.progress import progress_bar
from torchrec_tpu.planner.assembly import Choice, assemble_plan
from torchrec_tpu.planner.cost_model import Load, ShardingOption
from torchrec_tpu.planner.options import PlanningError, TableOptions, allowed_kinds
from torchrec_tpu.planner.plan import Plan
from torchrec_tpu.planner.tables import EmbeddingTable
from torchrec_tpu.topology import TPUTopology
from tpu_facts import DEFAULT_MAX_IDS_PER_PARTITION, GIB

__all__ = ["Partitioner", "PlanningError", "allowed_kinds", "plan_tables"]
_EPS = 1e-12


class Partitioner:
    """Plans ``tables`` on ``topology`` for a global ``batch_size`` (see module docstring): the
    search over the options :class:`~torchrec_tpu.planner.options.TableOptions` costs, its
    result assembled by :func:`~torchrec_tpu.planner.assembly.assemble_plan`."""

    def __init__(self, topology: TPUTopology, batch_size: int,
                 max_ids_per_partition: int = DEFAULT_MAX_IDS_PER_PARTITION,
                 constraints: Mapping[str, Any] | None = None) -> None:
        self.options = TableOptions(topology, batch_size, max_ids_per_partition, constraints)
        self.topology = topology
        self.d = topology.num_devices
        self.usable = self.options.usable

    # ---- search --------------------------------------------------------------------------------
    def plan(self, tables: Sequence[EmbeddingTable], progress: bool = False) -> Plan:
        if not tables:
            raise PlanningError("no tables to plan")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise PlanningError("duplicate table names")
        options = {t.name: self.options.feasible(t) for t in _progress(tables, progress, "costing tables")}
        self.placed_time = np.zeros(self.d)
        self.placed_mem = np.zeros(self.d)
        self.uniform = Load()
        self.choices: dict[str, Choice] = {}

        first = self._fit_memory(self._initial_options(options), options)
        for name, option in first.items():
            if not option.shards:
                self._apply(name, option, ())
        for name in sorted((n for n, o in first.items() if o.shards),
                           key=lambda n: (-first[n].max_shard_time_s, n)):
            self._place_or_fallback(name, [first[name]] + sorted(options[name], key=self._option_order))
        self._fill_valleys(options)
        self._relieve_slowest(options)
        return assemble_plan(self.options, tables, self.choices, self.lower_bound(options))

    def evaluate(self, tables: Sequence[EmbeddingTable],
                 assignments: Mapping[str, tuple[ShardingOption, tuple[int, ...]]]) -> Plan:
        """Cost a fixed assignment (table -> option, device per shard), e.g. TorchRec's plan."""
        missing = sorted({t.name for t in tables} - set(assignments))
        if missing:
            raise PlanningError(f"assignment lacks tables {missing}")
        bound = self.lower_bound({t.name: self.options.feasible(t) for t in tables})
        self.choices = {name: Choice(option, devices) for name, (option, devices) in assignments.items()}
        return assemble_plan(self.options, tables, self.choices, bound)

    def lower_bound(self, options: Mapping[str, list[ShardingOption]]) -> float:
        """No plan beats perfect balance of the least work, nor any table's own cheapest footprint
        on the device that holds its largest shard (bandwidth terms; overheads excluded)."""
        balance = sum(min(o.total_time_s(self.d) for o in opts) for opts in options.values()) / self.d
        critical = max(min(o.uniform.time_s + o.max_shard_time_s for o in opts) for opts in options.values())
        return max(balance, critical)

    def _option_order(self, o: ShardingOption) -> tuple[float, float]:
        return (o.max_shard_time_s, o.total_time_s(self.d))

    def _initial_options(self, options: Mapping[str, list[ShardingOption]]) -> dict[str, ShardingOption]:
        """Choose options against a fluid estimate of the final step time,
        ``uniform + max(placed work / D, the option's largest shard)``: what LPT placement reaches
        when placed work balances, but never less than one shard. Starts from the least-work
        options and re-chooses tables, largest shard first (two passes)."""
        chosen = {n: min(opts, key=lambda o: (o.total_time_s(self.d), o.max_shard_time_s))
                  for n, opts in options.items()}
        uniform = sum(o.uniform.time_s for o in chosen.values())
        placed = sum(_placed_work(o) for o in chosen.values())
        order = sorted(options, key=lambda n: (-chosen[n].max_shard_time_s, n))
        for _ in range(2):
            for name in order:
                current = chosen[name]
                uniform -= current.uniform.time_s
                placed -= _placed_work(current)

                def fluid(o: ShardingOption) -> tuple[float, float]:
                    spread = (placed + _placed_work(o)) / self.d
                    return uniform + o.uniform.time_s + max(spread, o.max_shard_time_s), o.total_time_s(self.d)

                chosen[name] = best = min(options[name], key=fluid)
                uniform += best.uniform.time_s
                placed += _placed_work(best)
        return chosen

    def _score(self) -> tuple[float, int]:
        """Slowest device time, then how many devices share it (so ties can be broken up)."""
        top = float(self.placed_time.max())
        return self.uniform.time_s + top, int((self.placed_time >= top * (1 - 1e-9)).sum())

    def _memory_ok(self) -> bool:
        return self.uniform.memory_bytes + float(self.placed_mem.max()) <= self.usable

    def _apply(self, name: str, option: ShardingOption, devices: tuple[int, ...], sign: int = 1) -> None:
        self.uniform = self.uniform + option.uniform.scaled(sign)
        for shard, dev in zip(option.shards, devices):
            self.placed_time[dev] += sign * shard.load.time_s
            self.placed_mem[dev] += sign * shard.load.memory_bytes
        if sign > 0:
            self.choices[name] = Choice(option, devices)
        else:
            del self.choices[name]

    def _try_place(self, name: str, option: ShardingOption) -> bool:
        """Apply ``option`` with its shards on the least-loaded devices that have room."""
        self.uniform = self.uniform + option.uniform
        room = self.usable - self.uniform.memory_bytes - self.placed_mem
        if float(room.min()) < 0:
            self.uniform = self.uniform + option.uniform.scaled(-1)
            return False
        devices: list[int] = []
        for shard in option.shards:
            candidates = np.where(room >= shard.load.memory_bytes, self.placed_time, np.inf)
            candidates[devices] = np.inf
            dev = int(candidates.argmin())
            if not np.isfinite(candidates[dev]):
                self.uniform = self.uniform + option.uniform.scaled(-1)
                return False
            devices.append(dev)
        self.uniform = self.uniform + option.uniform.scaled(-1)
        self._apply(name, option, tuple(devices))
        return True

    def _place_or_fallback(self, name: str, candidates: list[ShardingOption]) -> None:
        for option in candidates:
            if self._try_place(name, option):
                return
        raise PlanningError(
            f"table {name!r}: no device has room left for any of its shardings on {self.topology.name} "
            f"(usable {self.usable / GIB:.2f} GiB per device) after placing the larger tables; HBM is nearly full, "
            f"use a larger slice"
        )

    def _fit_memory(self, chosen: dict[str, ShardingOption],
                    options: Mapping[str, list[ShardingOption]]) -> dict[str, ShardingOption]:
        """Swap tables to their leanest option (largest saving first) until the average device
        fits; raise with the shortfall when even the leanest options do not."""
        mean = self.options.mean_memory
        lean = {n: min(opts, key=lambda o: (mean(o), o.total_time_s(self.d)))
                for n, opts in options.items()}
        need = sum(mean(o) for o in chosen.values())
        if need > self.usable:
            for name in sorted(chosen, key=lambda n: (mean(lean[n]) - mean(chosen[n]), n)):
                need += mean(lean[name]) - mean(chosen[name])
                chosen[name] = lean[name]
                if need <= self.usable:
                    break
        if need > self.usable:
            biggest = sorted(lean, key=lambda n: (-mean(lean[n]), n))[:3]
            listed = ", ".join(f"{n} ({mean(lean[n]) / GIB:.2f} GiB)" for n in biggest)
            raise PlanningError(
                f"the {len(chosen)} tables need {need / GIB:.2f} GiB per device on {self.topology.name} "
                f"even sharded as leanly as possible over all {self.d} devices, but a device has "
                f"{self.usable / GIB:.2f} GiB usable; shortfall {(need - self.usable) / GIB:.2f} GiB per "
                f"device. Largest per device: {listed}"
            )
        return chosen

    def _best_move(self, name: str, candidates: list[ShardingOption]) -> bool:
        """Re-shard/re-place ``name`` with the candidate that lowers the objective most."""
        current = self.choices[name]
        best_score = self._score()
        self._apply(name, current.option, current.devices, sign=-1)
        best: tuple[ShardingOption, tuple[int, ...]] | None = None
        for option in candidates:
            if self._try_place(name, option):
                score = self._score()
                if self._memory_ok() and _better(score, best_score):
                    best, best_score = (option, self.choices[name].devices), score
                self._apply(name, option, self.choices[name].devices, sign=-1)
        self._apply(name, *(best or (current.option, current.devices)))
        return best is not None

    def _fill_valleys(self, options: Mapping[str, list[ShardingOption]]) -> None:
        uniform = [n for n, c in self.choices.items() if not c.option.shards]
        for name in sorted(uniform, key=lambda n: (-self.choices[n].option.uniform.time_s, n)):
            placed = [o for o in options[name] if o.shards]
            if placed:
                self._best_move(name, placed)

    def _relieve_slowest(self, options: Mapping[str, list[ShardingOption]]) -> None:
        for _ in range(4 * len(options)):
            slowest = int(self.placed_time.argmax())
            on_slowest = [n for n, c in self.choices.items() if slowest in c.devices]
            on_slowest.sort(key=lambda n: (-self.choices[n].option.max_shard_time_s, n))
            if not any(self._best_move(n, options[n]) for n in on_slowest):
                return

def _placed_work(o: ShardingOption) -> float:
    return sum(s.load.time_s for s in o.shards)


def _better(a: tuple[float, int], b: tuple[float, int]) -> bool:
    if a[0] < b[0] * (1 - 1e-9) - _EPS:
        return True
    return a[0] <= b[0] * (1 + 1e-9) + _EPS and a[1] < b[1]


def _progress(items: Sequence[Any], enabled: bool, desc: str) -> Sequence[Any]:
    return progress_bar(items, enabled=enabled, desc=desc, unit="table") if enabled else items


def plan_tables(tables: Sequence[EmbeddingTable], topology: TPUTopology, batch_size: int,
                max_ids_per_partition: int = DEFAULT_MAX_IDS_PER_PARTITION,
                constraints: Mapping[str, Any] | None = None, progress: bool = False,
                dense_params: int = 0) -> Plan:
    """Plan ``tables`` on ``topology`` for global ``batch_size``; raises ``PlanningError``.
    ``dense_params``: the data-parallel parameters, whose gradient all-reduce the plan prices
    (``Plan.dense_allreduce_s``; it does not change where tables go)."""
    if dense_params < 0:
        raise ValueError(f"dense_params must be >= 0, got {dense_params}")
    plan = Partitioner(topology, batch_size, max_ids_per_partition, constraints).plan(tables, progress)
    return replace(plan, dense_params=dense_params)
