"""``--plan``: planner plans (from the real planner) become the sparsecore EBC's sharding; every
mismatch with the model or the world is a clear error naming the table and the value."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sparsecore import SGD, Adagrad, RowWiseAdagrad
from sparsecore.specs import FeatureSpec, TableSpec
from torchrec_tpu import cli
from torchrec_tpu.planner.id_limits import auto_id_limits, with_id_limits
from torchrec_tpu.planner.partitioner import plan_tables
from torchrec_tpu.planner.plan import Plan
from torchrec_tpu.planner.tables import tables_from_sparsecore_specs
from torchrec_tpu.sharding import TableSharding, balanced_table_wise
from torchrec_tpu.topology import parse_accelerator_type
from torchrec_tpu.train.engines.plan_loading import PlanLoadError, plan_for_world, resolve_sharding, sharding_from_plan

TABLES = [TableSpec("t_big", 4000, 16, optimizer=SGD(0.1)), TableSpec("t_wide", 300, 16, optimizer=SGD(0.1)),
          TableSpec("t_dense", 50, 8, optimizer=SGD(0.1)), TableSpec("t_small", 200, 8, optimizer=SGD(0.1))]
KINDS = {"t_big": "row_wise", "t_wide": "column_wise", "t_dense": "data_parallel", "t_small": "table_wise"}


def mixed_plan(tables: list[TableSpec] = TABLES, world_size: int = 2) -> Plan:
    """The planner's plan with each table constrained to the kind in KINDS."""
    return plan_tables(tables_from_sparsecore_specs(tables), parse_accelerator_type(f"v5p-1x1x{world_size}"),
                       batch_size=256, constraints={name: [kind] for name, kind in KINDS.items()})


def test_plan_devices_become_ranks(tmp_path: Path) -> None:
    plan = mixed_plan()
    assert {t.name: t.sharding_type for t in plan.tables} == KINDS
    wide = plan.table("t_wide").shards
    small_device = plan.table("t_small").shards[0].device
    expected = {
        "t_big": TableSharding("row_wise"),
        "t_wide": TableSharding("column_wise", tuple(s.device for s in sorted(wide, key=lambda s: s.column_offset))),
        "t_dense": TableSharding("data_parallel"),
        "t_small": TableSharding("table_wise", (small_device,)),
    }
    assert sorted(expected["t_wide"].ranks) == [0, 1]
    assert sharding_from_plan(plan, TABLES, 2) == expected
    path = tmp_path / "plan.json"
    plan.save(path)  # what `torchrec-tpu plan --out` writes
    assert resolve_sharding(str(path), TABLES, (), 2, 256).sharding == expected


def test_auto_plans_for_the_world_and_none_balances_table_wise() -> None:
    for world in (1, 2):
        sharding = resolve_sharding("auto", TABLES, (), world, 256).sharding
        expected = sharding_from_plan(plan_tables(tables_from_sparsecore_specs(TABLES),
                                                  parse_accelerator_type(f"v5p-1x1x{world}"), 256), TABLES, world)
        assert sharding == expected and set(sharding) == set(KINDS)
    assert resolve_sharding(None, TABLES, (), 2, 256).sharding == balanced_table_wise(TABLES, 2)


def test_auto_plans_with_the_features() -> None:
    """``--plan auto`` plans each table for the features that look it up: two features of valency 4
    on ``t_big`` are 8 lookups per sample, which the plan's ids per partition show (planning the
    bare tables would assume one lookup)."""
    features = [FeatureSpec("f_big", "t_big", 256, max_ids_per_sample=4),
                FeatureSpec("f_big2", "t_big", 256, max_ids_per_sample=4),
                *(FeatureSpec(f"f_{t.name}", t.name, 256) for t in TABLES[1:])]
    topology = parse_accelerator_type("v5p-1x1x2")
    with_features = plan_for_world(TABLES, features, 2, 256)
    # as `torchrec-tpu plan` plans them: each table's id limits from its pooling factor and the batch
    as_plan_sets_them = [dataclasses.replace(t, max_ids_per_partition=None)
                         for t in tables_from_sparsecore_specs(TABLES, features)]
    as_plan_sets_them = with_id_limits(as_plan_sets_them, auto_id_limits(as_plan_sets_them, topology, 256))
    assert with_features == plan_tables(as_plan_sets_them, topology, 256)
    assert with_features.table("t_big").max_ids_per_partition != TABLES[0].max_ids_per_partition
    bare = plan_tables(tables_from_sparsecore_specs(TABLES), topology, 256)
    assert with_features.table("t_big").ids_per_partition > bare.table("t_big").ids_per_partition
    # and resolve_sharding("auto") plans with them
    assert resolve_sharding("auto", TABLES, features, 2, 256).sharding == sharding_from_plan(
        with_features, TABLES, 2)


def _with_table(plan: Plan, name: str, **changes: object) -> Plan:
    tables = tuple(dataclasses.replace(t, **changes) if t.name == name else t for t in plan.tables)
    return dataclasses.replace(plan, tables=tables)


@pytest.mark.parametrize("world,model,edit,message", [
    (1, TABLES, None, r"made for 2 device\(s\) \(v5p-4\) but training runs on 1 rank\(s\)"),
    (2, TABLES[:3], None, r"names tables the model does not have: \['t_small'\]"),
    (2, TABLES + [TableSpec("t_new", 10, 8)], None, r"lacks the model's tables \['t_new'\]"),
    (2, TABLES, ("t_big", {"rows": 5000}), r"table 't_big' has rows=5000 but the model's table has rows=4000"),
    (2, TABLES, ("t_small", {"dim": 16}), r"table 't_small' has dim=16 but the model's table has dim=8"),
    (2, TABLES, ("t_small", {"sharding_type": "grid_wise"}),
     r"table 't_small': sharding type 'grid_wise' is not supported; supported: \['table_wise'"),
])
def test_mismatches_name_the_table_and_value(world, model, edit, message) -> None:
    plan = mixed_plan()
    if edit:
        plan = _with_table(plan, edit[0], **edit[1])
    with pytest.raises(PlanLoadError, match=message):
        sharding_from_plan(plan, model, world)


def test_shardings_the_ebc_cannot_run_are_errors() -> None:
    rowwise = [dataclasses.replace(t, optimizer=RowWiseAdagrad(0.1)) for t in TABLES]
    assert sharding_from_plan(mixed_plan(rowwise), rowwise, 2)["t_wide"].kind == "column_wise"  # as TorchRec
    # dim 12 pads to 16: blocks [0:8] and [8:16] hold 8 and 4 real columns
    uneven = [dataclasses.replace(t, dim=12) if t.name == "t_wide" else t for t in TABLES]
    with pytest.raises(PlanLoadError, match=r"table 't_wide' \(column_wise\): column blocks of \[8, 4\] real"):
        sharding_from_plan(mixed_plan(uneven), uneven, 2)
    plan = mixed_plan()
    moved = tuple(dataclasses.replace(s, device=5) for s in plan.table("t_small").shards)
    with pytest.raises(PlanLoadError, match="table 't_small' \\(table_wise\\): shard on device 5, not a rank"):
        sharding_from_plan(_with_table(plan, "t_small", shards=moved), TABLES, 2)


def test_a_plan_for_another_optimizer_warns() -> None:
    adagrad = [dataclasses.replace(t, optimizer=Adagrad(0.1)) for t in TABLES]
    with pytest.warns(UserWarning, match=r"tables \['t_big', .*\] were planned for optimizer 'sgd' but train "
                                         r"with 'adagrad'"):
        assert sharding_from_plan(mixed_plan(), adagrad, 2) == sharding_from_plan(mixed_plan(), TABLES, 2)


def test_bad_files_and_worlds(tmp_path: Path) -> None:
    with pytest.raises(PlanLoadError, match="--plan='.*nope.json': no such file"):
        resolve_sharding(str(tmp_path / "nope.json"), TABLES, (), 2, 256)
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(PlanLoadError, match="bad.json'.*not a torchrec_tpu.plan/v1 plan"):
        resolve_sharding(str(tmp_path / "bad.json"), TABLES, (), 2, 256)
    with pytest.raises(PlanLoadError, match=r"--plan=auto on 3 rank\(s\): .*power-of-two SparseCore count"):
        resolve_sharding("auto", TABLES, (), 3, 256)


def test_cli_reports_plan_errors_without_traceback(tiny_dataset: Path, tmp_path: Path, capsys) -> None:
    common = ["train", "--data", str(tiny_dataset), "--log-dir", str(tmp_path / "logs"), "--no-progress"]
    assert cli.main([*common, "--engine", "torchrec", "--plan", "auto"]) == 2
    assert "--plan='auto' needs --engine sparsecore" in capsys.readouterr().err
    plan = tmp_path / "plan.json"
    plan_tables(tables_from_sparsecore_specs(TABLES), parse_accelerator_type("v5p-1x1x1"), 256).save(plan)
    assert cli.main([*common, "--engine", "sparsecore", "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "table 't_dense' has dim=8 but the model's tables have --embedding-dim=16" in err  # before any data
    assert "Traceback" not in err
    config = tmp_path / "train.yaml"  # the same option as a config file key
    config.write_text(f"engine: sparsecore\nplan: {tmp_path / 'missing.json'}\n")
    assert cli.main([*common, "--config", str(config)]) == 2
    assert "missing.json': no such file" in capsys.readouterr().err
