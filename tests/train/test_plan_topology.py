"""A plan's slice reaches the sharded EBC: a rank's local stacks are laid out for the plan's chip
(v6e: 2 SparseCores per device, tpu7x: one chiplet of 2), not for the default v5p chip (4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparsecore.specs import SparseCoreTopology
from tests.train.conftest import TINY_OPTIONS, as_flags, cpu_layout, tiny_config
from torchrec_tpu import cli
from torchrec_tpu.planner.partitioner import plan_tables
from torchrec_tpu.planner.plan import load_plan
from torchrec_tpu.planner.tables import tables_from_sparsecore_specs
from torchrec_tpu.topology import parse_accelerator_type
from torchrec_tpu.train.config import EngineConfig
from torchrec_tpu.train.data import open_data
from torchrec_tpu.train.distributed import process_group
from torchrec_tpu.train.engines.plan_loading import PlanLoadError, resolve_sharding
from torchrec_tpu.train.engines.sparsecore_engine import build_sparsecore_model
from torchrec_tpu.train.job import model_spec

BATCH = int(TINY_OPTIONS["batch_size"])  # type: ignore[call-overload]


def _model_tables(tiny_dataset: Path, tmp_path: Path):
    """The tiny job's sparsecore model, built with no plan, and its table specs."""
    config = tiny_config(tiny_dataset, tmp_path / "logs", engine="sparsecore")
    with process_group() as env, open_data(config, env) as data:
        spec = model_spec(config, data.schema.sparse, data.table_sizes, len(data.schema.dense))
        model = build_sparsecore_model(spec, env, cpu_layout(config, env.world_size), config.optim, config.engine,
                                       BATCH, config.loop.seed)
    ebc = model.model.sparse_arch.embedding_bag_collection
    return config, spec, ebc


def _save_plan(tables, accelerator: str, path: Path) -> Path:
    plan_tables(tables_from_sparsecore_specs(tables), parse_accelerator_type(accelerator), BATCH).save(path)
    return path


def test_without_a_plan_stacks_use_one_v5p_chip_per_rank(tiny_dataset: Path, tmp_path: Path) -> None:
    _, _, ebc = _model_tables(tiny_dataset, tmp_path)
    assert ebc._backend.plan.topology == SparseCoreTopology("v5p", 1)
    assert ebc._backend.plan.topology.num_sparsecores == 4


def test_a_v6e_plan_lays_the_stacks_out_on_two_sparsecores(tiny_dataset: Path, tmp_path: Path) -> None:
    config, spec, ebc = _model_tables(tiny_dataset, tmp_path)
    plan = _save_plan(list(ebc.tables.values()), "v6e-1", tmp_path / "v6e.json")
    assert load_plan(plan).topology.chip.name == "v6e"
    with process_group() as env:
        model = build_sparsecore_model(spec, env, cpu_layout(config, env.world_size), config.optim,
                                       EngineConfig(plan=str(plan)), BATCH, config.loop.seed)
    stacking = model.model.sparse_arch.embedding_bag_collection._backend.plan
    assert stacking.topology == SparseCoreTopology("v6e", 1)
    assert stacking.topology.num_sparsecores == 2
    # every stack's rows are split over the 2 SparseCores, as jax-tpu-embedding lays out a v6e device
    assert {stack.num_sparsecores for stack in stacking.stacks} == {2}
    assert all(stack.shard_rows * 2 == stack.vocab_size for stack in stacking.stacks)
    argv = ["train", "--data", str(tiny_dataset), "--log-dir", str(tmp_path / "run"),
            *as_flags({**TINY_OPTIONS, "engine": "sparsecore", "max_steps": 4}), "--plan", str(plan)]
    assert cli.main(argv) == 0


def test_a_tpu7x_plan_gives_each_rank_one_chiplet(tiny_dataset: Path, tmp_path: Path) -> None:
    _, _, ebc = _model_tables(tiny_dataset, tmp_path)
    tables = list(ebc.tables.values())
    plan = _save_plan(tables, "tpu7x-1x1x1", tmp_path / "tpu7x.json")  # one chip = two chiplets
    placement = resolve_sharding(str(plan), tables, (), 2, BATCH)
    assert placement.rank_topology == SparseCoreTopology("tpu7x", 1, num_devices=1)
    assert placement.rank_topology.num_sparsecores == 2
    with pytest.raises(PlanLoadError, match="made for 2 device"):
        resolve_sharding(str(plan), tables, (), 1, BATCH)
