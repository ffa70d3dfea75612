"""TPU-aware embedding sharding planner: SparseCore cost model, fast search, plan JSON, reports.

Public API: ``EmbeddingTable`` / ``load_tables`` (inputs), ``plan_tables`` (search),
``Plan`` / ``load_plan`` / ``to_torchrec_sharding_plan`` (output), ``PlanningError``.
"""

from torchrec_tpu.planner.partitioner import PlanningError, plan_tables
from torchrec_tpu.planner.plan import Plan, load_plan, to_torchrec_sharding_plan
from torchrec_tpu.planner.tables import EmbeddingTable, load_tables, tables_from_configs

__all__ = [
    "EmbeddingTable",
    "Plan",
    "PlanningError",
    "load_plan",
    "load_tables",
    "plan_tables",
    "tables_from_configs",
    "to_torchrec_sharding_plan",
]
