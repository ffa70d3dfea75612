"""The plan a training job loads: typed dataclasses, deterministic JSON, TorchRec conversion.

JSON is written with sorted keys and no timestamps, so the same input gives byte-identical files, and
read back after a check against its JSON Schema (``plan.schema.json`` next to this module).
``to_torchrec_sharding_plan`` maps the plan onto TorchRec's ``ParameterSharding`` types: row-wise
tables become contiguous row blocks of R'/D rows per rank (TorchRec cannot express SparseCore mod
sharding, id mod N; the block sizes and memory are the same, the id->row mapping is not).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from torchrec_tpu.planner.plan_checks import check_plan
from torchrec_tpu.structured_files import brief, read_structured
from torchrec_tpu.topology import CostConstants, TPUTopology
from tpu_facts import Slice

PLAN_FORMAT = "torchrec_tpu.plan/v1"
SCHEMA_PATH = Path(__file__).with_name("plan.schema.json")  # JSON Schema 2020-12 of the plan JSON (docs/PLAN_FORMAT.md)
GRADIENT_BYTES = 4  # float32 dense gradients


@dataclass(frozen=True)
class ShardPlacement:
    """Columns [column_offset, column_offset + columns) of ``rows`` padded rows on ``device``;
    ``device`` None means every device holds ``rows`` rows (row-wise / data-parallel)."""

    device: int | None
    column_offset: int
    columns: int
    rows: int

    def real_columns(self, dim: int) -> int:
        """Columns of a ``dim``-wide table in this block (padding to 8 lives only in the last)."""
        return max(0, min(self.columns, dim - self.column_offset))


@dataclass(frozen=True)
class TablePlan:
    name: str
    rows: int
    dim: int
    padded_dim: int
    sharding_type: str
    optimizer: str
    shards: tuple[ShardPlacement, ...]
    stack: str
    hbm_bytes: int  # parameters + slots, all devices together
    est_time_s: float  # summed over devices
    ids_per_partition: float
    max_ids_per_partition: int = 0  # the id limit it was planned under (0: plans from before it was recorded)


@dataclass(frozen=True)
class DevicePlan:
    device: int
    chip: int
    hbm_bytes: int  # parameters + optimizer slots
    buffer_bytes: int  # activations + all-to-all buffers
    lookup_s: float
    comm_s: float
    overhead_s: float  # per-stack kernel overhead + collective latency
    num_stacks: int
    placed_tables: tuple[str, ...]  # table-/column-wise tables with a shard here
    input_bytes: int = 0  # ids (CSR) its SparseCores look up per step (0: plans from before it was recorded)
    output_bytes: int = 0  # pooled rows / partial sums it returns per step
    host_bytes: int = 0  # its shards' managed-collision remaps, on its host (not HBM)

    @property
    def memory_bytes(self) -> int:
        return self.hbm_bytes + self.buffer_bytes

    @property
    def time_s(self) -> float:
        return self.lookup_s + self.comm_s + self.overhead_s


@dataclass(frozen=True)
class StackPlan:
    name: str
    device: int | None  # None: stacked on every device (row-wise)
    tables: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    topology: TPUTopology
    batch_size: int
    max_ids_per_partition: int
    usable_hbm_bytes_per_device: int
    tables: tuple[TablePlan, ...]
    devices: tuple[DevicePlan, ...]
    stacks: tuple[StackPlan, ...]
    lower_bound_s: float
    warnings: tuple[str, ...] = ()
    dense_params: int = 0  # data-parallel (dense) parameters whose float32 gradients are all-reduced

    @property
    def step_time_s(self) -> float:
        """Estimated per-step embedding time of the slowest device."""
        return max(d.time_s for d in self.devices)

    @property
    def dense_allreduce_s(self) -> float:
        """Estimated per-step all-reduce of the dense gradients, hierarchical over ICI then DCN
        (:meth:`~torchrec_tpu.topology.TPUTopology.allreduce_seconds`); not part of ``step_time_s``."""
        return self.topology.allreduce_seconds(GRADIENT_BYTES * self.dense_params)

    @property
    def quality(self) -> float:
        """Slowest device over the perfect-balance lower bound (1.0 is optimal)."""
        return self.step_time_s / self.lower_bound_s if self.lower_bound_s > 0 else 1.0

    @property
    def max_memory_bytes(self) -> int:
        return max(d.memory_bytes for d in self.devices)

    @property
    def max_host_bytes(self) -> int:
        """The largest device's managed-collision remaps (host memory)."""
        return max(d.host_bytes for d in self.devices)

    def table(self, name: str) -> TablePlan:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"no table {name!r} in plan")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["topology"] = self.topology.to_dict()
        data["format"] = PLAN_FORMAT
        data["summary"] = {"step_time_s": self.step_time_s, "lower_bound_s": self.lower_bound_s,
                           "quality": self.quality, "max_memory_bytes": self.max_memory_bytes,
                           "dense_allreduce_s": self.dense_allreduce_s}
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


@functools.cache
def _schema_validator() -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))


def check_plan_json(data: Any) -> None:
    """ValueError naming the first way ``data`` breaks the plan's JSON Schema, and where."""
    import jsonschema

    if isinstance(data, dict) and data.get("format") != PLAN_FORMAT:  # another file altogether
        raise ValueError(f"not a {PLAN_FORMAT} plan (format={brief(data.get('format'))})")
    error = jsonschema.exceptions.best_match(_schema_validator().iter_errors(data))
    if error is not None:
        where = _json_location(data, error.absolute_path)
        raise ValueError(f"not a valid {PLAN_FORMAT} plan: {error.message:.200} (at {where})")


def _json_location(data: Any, path: Iterable[str | int]) -> str:
    """``.tables[2] (table 't_C3').sharding_type``: a JSON path, naming each named list element."""
    where, node, list_name = "", data, ""
    for key in path:
        node = node[key]
        if isinstance(key, int):
            where += f"[{key}]"
            if isinstance(node, dict) and "name" in node:  # "tables" -> table 'name'
                where += f" ({list_name.removesuffix('s')} {brief(node['name'])})"
        else:
            where, list_name = f"{where}.{key}", key
    return where or "the top level"


def plan_from_dict(data: dict[str, Any]) -> Plan:
    """Inverse of ``Plan.to_dict``, checked against the JSON Schema first (the summary is
    recomputed, not trusted)."""
    check_plan_json(data)
    tables = tuple(TablePlan(**{**t, "shards": tuple(ShardPlacement(**s) for s in t["shards"])})
                   for t in data["tables"])
    # plans from before data-parallel tables were priced as the runtime runs them carry an
    # all-reduce time per device; nothing reads it any more
    devices = tuple(DevicePlan(**{**{k: v for k, v in d.items() if k != "allreduce_s"},
                                  "placed_tables": tuple(d["placed_tables"])}) for d in data["devices"])
    stacks = tuple(StackPlan(s["name"], s["device"], tuple(s["tables"])) for s in data["stacks"])
    plan = Plan(_topology_from_dict(data["topology"]), data["batch_size"], data["max_ids_per_partition"],
                data["usable_hbm_bytes_per_device"], tables, devices, stacks, data["lower_bound_s"],
                tuple(data["warnings"]), int(data.get("dense_params", 0)))
    check_plan(plan)  # a hand-edited shard field fails here, naming the table and field
    return plan


def _topology_from_dict(data: dict[str, Any]) -> TPUTopology:
    base = Slice.from_dict(data)
    return TPUTopology(base.chip, base.shape, base.num_slices, CostConstants(**data.get("costs", {})))


def load_plan(path: str | Path) -> Plan:
    """Read a plan JSON written by ``Plan.save`` / ``torchrec-tpu plan``."""
    data = read_structured(Path(path))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a plan JSON holds an object, got a {type(data).__name__}")
    return plan_from_dict(data)


def to_torchrec_sharding_plan(plan: Plan, module_path: str = "", compute_kernel: str = "fused") -> Any:
    """A ``torchrec.distributed.types.ShardingPlan`` with one ``ParameterSharding`` per table,
    ranks = device indices, for an EmbeddingBagCollection at ``module_path``."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    num_devices = len(plan.devices)
    module_plan = EmbeddingModuleShardingPlan()
    for t in plan.tables:
        if t.sharding_type == "data_parallel":
            module_plan[t.name] = ParameterSharding("data_parallel", "dense", list(range(num_devices)))
            continue
        if t.sharding_type == "row_wise":
            block = t.shards[0].rows
            metas = [ShardMetadata([r * block, 0], [max(0, min(block, t.rows - r * block)), t.dim], f"rank:{r}/cpu")
                     for r in range(num_devices)]
            ranks = list(range(num_devices))
        else:
            metas = [ShardMetadata([0, s.column_offset], [t.rows, s.real_columns(t.dim)], f"rank:{s.device}/cpu")
                     for s in t.shards]
            ranks = [s.device for s in t.shards]
        module_plan[t.name] = ParameterSharding(t.sharding_type, compute_kernel, ranks, EnumerableShardingSpec(metas))
    return ShardingPlan({module_path: module_plan})

