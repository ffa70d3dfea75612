"""A hand-edited plan is checked against its slice before training: shard rows, columns, devices
and the sharding type of each table; the error names the plan, the table, the field and the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.faults.conftest import TRAIN_FLAGS
from tests.faults.helpers import assert_clean_error
from torchrec_tpu.cli import main


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The planner's plan of the fault tests' model (26 tables of 100 x 8) on one v5p chip."""
    root = tmp_path_factory.mktemp("plan")
    tables = root / "tables.yaml"
    tables.write_text("".join(f"- {{name: t_C{i}, rows: 100, dim: 8}}\n" for i in range(1, 27)))
    assert main(["plan", "--tables", str(tables), "--topology", "v5p-1x1x1", "--batch-size", "64",
                 "--out", str(root / "plan.json"), "--no-progress"]) == 0
    return json.loads((root / "plan.json").read_text())


def _edited(plan: dict, path: Path, field: str, value: object) -> Path:
    edited = json.loads(json.dumps(plan))
    table = next(t for t in edited["tables"] if t["name"] == "t_C3")
    if field == "sharding_type":
        table[field] = value
    else:
        table["shards"][0][field] = value
    path.write_text(json.dumps(edited))
    return path


@pytest.mark.parametrize("field, value, expected", [
    ("rows", 7, "rows=7, expected"),
    ("rows", 10_000, "rows=10000, expected"),
    ("column_offset", 8, "column_offset=8, expected 0"),
    ("columns", 16, "the shards' columns end at 16, expected 8"),
    ("device", 3, "device=3"),
    ("sharding_type", "diagonal", "'diagonal' is not one of"),
])
def test_hand_edited_shard_fields_are_refused_before_training(capsys, plan_json, tiny_dataset, tmp_path,
                                                              field, value, expected):
    plan = _edited(plan_json, tmp_path / "plan.json", field, value)
    rc = main(["train", "--data", str(tiny_dataset), *TRAIN_FLAGS, "--log-dir", str(tmp_path / "run"),
               "--plan", str(plan)])
    line = assert_clean_error(rc, capsys.readouterr().err, f"--plan={str(plan)!r}", "table 't_C3'", expected)
    assert not list((tmp_path / "run").glob("checkpoint/checkpoint.*")), line  # refused before any save
