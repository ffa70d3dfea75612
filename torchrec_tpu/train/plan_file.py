"""``--plan FILE``: read and checked against the world and the model's embedding dim without torch,
so a truncated plan or one made for another topology fails before anything heavy starts
(:mod:`torchrec_tpu.train.preflight`); :mod:`~torchrec_tpu.train.engines.plan_loading` checks the rest."""

from __future__ import annotations

from pathlib import Path

from torchrec_tpu.planner.plan import Plan, load_plan
from torchrec_tpu.train.config import ConfigError


class PlanLoadError(ConfigError):
    """The plan cannot shard this model on this world; the message names the table and value."""


def read_plan(path: str) -> Plan:
    """The plan JSON at ``path``; PlanLoadError if it is missing or not a plan."""
    if not Path(path).is_file():
        raise PlanLoadError(f"--plan={path!r}: no such file (write one with `torchrec-tpu plan --out`)")
    try:
        return load_plan(path)
    except ValueError as err:  # includes JSONDecodeError
        raise PlanLoadError(f"--plan={path!r}: {err}") from None


def check_plan_world(plan: Plan, world_size: int, source: str) -> None:
    """PlanLoadError unless ``plan`` has one device per rank of ``world_size`` (plan device d = rank d)."""
    if len(plan.devices) != world_size:
        raise PlanLoadError(f"{source} was made for {len(plan.devices)} device(s) "
                            f"({plan.topology.name}) but training runs on {world_size} rank(s); "
                            f"plan for a topology with {world_size} device(s) or use --plan=auto")


def check_plan_dim(plan: Plan, embedding_dim: int, source: str) -> None:
    """PlanLoadError naming the first table of ``plan`` whose dim is not ``embedding_dim`` (every DLRM table's)."""
    for table in plan.tables:
        if table.dim != embedding_dim:
            raise PlanLoadError(f"{source}: table {table.name!r} has dim={table.dim} but the model's tables have "
                                f"--embedding-dim={embedding_dim}")
