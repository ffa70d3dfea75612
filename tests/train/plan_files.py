"""Planner plans for training tests: the plan of a job's tables on some devices, written where
``--plan`` reads it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from tests.train.conftest import cpu_layout
from torchrec_tpu.planner.partitioner import plan_tables
from torchrec_tpu.planner.plan import Plan
from torchrec_tpu.planner.tables import tables_from_sparsecore_specs
from torchrec_tpu.topology import parse_accelerator_type
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.data import open_data
from torchrec_tpu.train.distributed import DistEnv
from torchrec_tpu.train.engines.sparsecore_engine import build_sparsecore_model
from torchrec_tpu.train.job import model_spec
from torchrec_tpu.train.model import ModelSpec


def write_plan(config: TrainConfig, world_size: int, kinds: Mapping[str, str], path: Path) -> Plan:
    """The planner's plan for the job's tables on ``world_size`` devices, ``kinds`` constrained."""
    model = build_sparsecore_model(job_spec(config), DistEnv(0, 1, 1), cpu_layout(config, 1), config.optim,
                                   config.engine, config.data.batch_size, config.loop.seed)
    tables = tables_from_sparsecore_specs(sparse_module(model).tables.values())
    plan = plan_tables(tables, parse_accelerator_type(f"v5p-1x1x{world_size}"), config.data.batch_size,
                       constraints={name: [kind] for name, kind in kinds.items()})
    plan.save(path)
    return plan


def job_spec(config: TrainConfig) -> ModelSpec:
    """The model spec a job of ``config`` builds."""
    with open_data(config, DistEnv(0, 1, 1)) as data:
        return model_spec(config, data.schema.sparse, data.table_sizes, len(data.schema.dense))


def sparse_module(model: torch.nn.Module) -> torch.nn.Module:
    """The sparsecore job model's sharded EBC."""
    return model.model.sparse_arch.embedding_bag_collection
