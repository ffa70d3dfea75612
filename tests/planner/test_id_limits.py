"""Per-table id limits chosen without --max-ids-per-partition, and the README planner examples."""

import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from torchrec_tpu.cli import main
from torchrec_tpu.planner import load_plan, load_tables
from torchrec_tpu.planner.id_limits import auto_id_limits, describe_id_limits
from torchrec_tpu.topology import resolve_topology
from tpu_facts import MAX_IDS_PER_PARTITION_CEILING

REPO = Path(__file__).resolve().parents[2]
DLRM_TABLES = REPO / "examples" / "planner" / "dlrm_dcnv2_tables.yaml"


def test_auto_limits_follow_pooling_and_batch_rounded_and_capped():
    tables = {t.name: t for t in load_tables(str(DLRM_TABLES))}
    topology = resolve_topology("v5p-64")
    limits = auto_id_limits(list(tables.values()), topology, 65536)
    # table-wise C1 (pooling 3): 2048 samples per device / 4 SparseCores * 3 ids * skew / 4 destinations
    expected = 2048 / 4 * 3 * topology.costs.skew / 4
    assert limits["C1"] == -(-int(expected) // 8) * 8
    assert all(v % 8 == 0 and 8 <= v <= MAX_IDS_PER_PARTITION_CEILING for v in limits.values())
    assert limits["C21"] == MAX_IDS_PER_PARTITION_CEILING  # 100 ids per sample: capped
    assert limits["C22"] > limits["C1"]  # more ids per sample, a larger limit
    assert auto_id_limits(list(tables.values()), topology, 32768)["C1"] < limits["C1"]
    own = replace(tables["C1"], max_ids_per_partition=100)
    assert "C1" not in auto_id_limits([own], topology, 65536)
    assert describe_id_limits({"a": 8, "b": 16, "c": 8}) == "b 16, a 8, c 8"
    assert describe_id_limits({"a": 8, "b": 8}) == "8 for all 2 tables"
    many = {f"t{i}": 8 * i for i in range(1, 8)}
    assert describe_id_limits(many) == "8 to 56: t7 56, t6 48, t5 40, t4 32, 3 more from 8 to 24"


def test_default_plans_the_mlperf_tables_and_prints_the_limits(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(DLRM_TABLES), "--topology", "v5p-64", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "max_ids_per_partition per table, from pooling factor and batch" in text
    assert f"  v5p-64: 128 to {MAX_IDS_PER_PARTITION_CEILING}: C21 {MAX_IDS_PER_PARTITION_CEILING}," in text
    plan = load_plan(out)
    assert plan.table("C21").max_ids_per_partition == MAX_IDS_PER_PARTITION_CEILING
    assert plan.table("C21").ids_per_partition <= MAX_IDS_PER_PARTITION_CEILING


def test_explicit_limit_is_kept(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(DLRM_TABLES), "--topology", "v5p-64", "--max-ids-per-partition", "4096",
                 "--out", str(out)]) == 0
    assert "auto" not in capsys.readouterr().out
    assert {t.max_ids_per_partition for t in load_plan(out).tables} == {4096}


def _readme_plan_commands() -> list[str]:
    commands = []
    for readme in (REPO / "README.md", REPO / "examples" / "planner" / "README.md"):
        text = readme.read_text().replace("\\\n", " ")
        commands += re.findall(r"torchrec-tpu plan --tables examples/planner/dlrm_dcnv2_tables\.yaml[^`\n]*", text)
    return commands


@pytest.mark.parametrize("command", _readme_plan_commands())
def test_readme_planner_examples_plan(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [str(DLRM_TABLES) if a.endswith("dlrm_dcnv2_tables.yaml") else a for a in shlex.split(command)[2:]]
    assert main(["plan", *argv]) == 0, capsys.readouterr().err
    assert "no plan" not in capsys.readouterr().out
