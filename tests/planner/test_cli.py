"""`torchrec-tpu plan` end to end: files in, plan JSON / terminal table / HTML report out."""

import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from torchrec_tpu.cli import main
from torchrec_tpu.planner import load_plan

REPO = Path(__file__).resolve().parents[2]
DLRM_TABLES = REPO / "examples" / "planner" / "dlrm_dcnv2_tables.yaml"
SVG = "{http://www.w3.org/2000/svg}"


def test_cli_subprocess_writes_plan_and_html(tmp_path):
    out, html = tmp_path / "plan.json", tmp_path / "plan.html"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "torchrec_tpu.cli", "plan", "--tables", str(DLRM_TABLES), "--topology", "v5p-64",
         "--batch-size", "55296", "--max-ids-per-partition", "2048", "--out", str(out), "--html", str(html)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "v5p-64 (2x4x4, 32 devices" in result.stdout
    plan = load_plan(out)
    assert len(plan.tables) == 26 and len(plan.devices) == 32
    root = ET.parse(html).getroot()  # well-formed XHTML
    assert len(root.findall(f".//{SVG}svg")) == 3  # HBM, step time, placement (tests/planner/test_report.py)
    assert "C21" in html.read_text()


def test_cli_is_deterministic(tmp_path):
    args = ["--tables", str(DLRM_TABLES), "--topology", "v6e-64", "--batch-size", "65536", "--max-ids-per-partition",
            "4096"]
    assert main(["plan", *args, "--out", str(tmp_path / "a.json")]) == 0
    assert main(["plan", *args, "--out", str(tmp_path / "b.json")]) == 0
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_compare_mode(tmp_path, capsys):
    code = main(["plan", "--tables", str(DLRM_TABLES), "--compare", "v5p-64,v6e-64,tpu7x-64", "--batch-size", "65536",
                 "--max-ids-per-partition", "4096", "--out", str(tmp_path / "plan.json")])
    assert code == 0
    text = capsys.readouterr().out
    for name in ("v5p-64", "v6e-64", "tpu7x-64"):
        assert name in text
        assert len(load_plan(tmp_path / f"plan.{name}.json").devices) == {"v5p-64": 32, "v6e-64": 64,
                                                                          "tpu7x-64": 64}[name]


def test_csv_tables_and_pooling_override(tmp_path):
    csv = tmp_path / "tables.csv"
    csv.write_text("name,rows,dim,pooling_factor,optimizer\nads,100000,64,2,adagrad\nusers,5000,32,1,sgd\n")
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(csv), "--topology", "v5p-8", "--batch-size", "1024",
                 "--pooling-factor", "users=4", "--out", str(out)]) == 0
    plan = load_plan(out)
    assert {t.name for t in plan.tables} == {"ads", "users"}
    assert plan.batch_size == 1024


def test_python_model_target(tmp_path, monkeypatch):
    (tmp_path / "my_model.py").write_text(textwrap.dedent("""
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        def make_ebc():
            return EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=1000, feature_names=["f0"]),
                EmbeddingBagConfig(name="t1", embedding_dim=32, num_embeddings=50000, feature_names=["f1"]),
            ], device=__import__("torch").device("meta"))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", "my_model:make_ebc", "--topology", "v6e-8", "--batch-size", "512",
                 "--out", str(out)]) == 0
    assert [t.name for t in load_plan(out).tables] == ["t0", "t1"]


def test_infeasible_table_exits_2_and_names_it_once(tmp_path, capsys):
    yaml = tmp_path / "t.yaml"
    yaml.write_text("- {name: giant, rows: 2000000000, dim: 256, optimizer: adam}\n")
    assert main(["plan", "--tables", str(yaml), "--topology", "v6e-8", "--batch-size", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and err.startswith("torchrec-tpu plan: error: table 'giant'")
    assert "shortfall" in err and "GiB" in err


def test_compare_failures_are_reported_once(capsys):
    code = main(["plan", "--tables", str(DLRM_TABLES), "--compare", "v5p-8,v5p-64", "--batch-size", "65536",
                 "--max-ids-per-partition", "256"])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out.count("no plan:") == 2  # each topology's reason, in the comparison table
    assert captured.err.strip().splitlines() == ["torchrec-tpu plan: error: no plan for v5p-8, v5p-64 (reasons in "
                                                 "the table above)"]


@pytest.mark.parametrize(
    "content, message",
    [
        ("- {name: a, rows: 10}\n", "missing required keys"),
        ("- {name: a, rows: 10, dim: 8, colour: red}\n", "unknown keys"),
        ("- {name: a, rows: 10, dim: 8, optimizer: lion}\n", "optimizer 'lion' unknown"),
        ("- {name: a, rows: 10, dim: 8}\n- {name: a, rows: 10, dim: 8}\n", "duplicate table name"),
    ],
)
def test_bad_tables_file(tmp_path, capsys, content, message):
    path = tmp_path / "t.yaml"
    path.write_text(content)
    assert main(["plan", "--tables", str(path), "--topology", "v5p-8"]) == 2
    assert message in capsys.readouterr().err


def test_multislice_and_topology_file(tmp_path, capsys):
    topo = tmp_path / "topo.yaml"
    topo.write_text("slice: v5p-8\ncosts:\n  hbm_reserved_fraction: 0.5\n")
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(DLRM_TABLES), "--topology", str(topo), "--slices", "4",
                 "--batch-size", "16384", "--max-ids-per-partition", "4096", "--out", str(out)]) == 0
    plan = load_plan(out)
    assert len(plan.devices) == 16 and plan.topology.num_slices == 4
    assert plan.usable_hbm_bytes_per_device == int(95 * 2**30 * 0.5)
    assert "v5p-8 x4 slices" in capsys.readouterr().out


def test_dense_params_price_the_hierarchical_all_reduce(tmp_path, capsys):
    """v5p-8 x 2 slices (2 chips per slice), 1M dense params = 4 MB of float32 gradient: ICI
    2 * 1/2 * 4e6 / 600e9, DCN 2 * 1/2 * (4e6 / 2) / 6.25e9, 3 phases of 10 us latency."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(DLRM_TABLES), "--topology", "v5p-8", "--slices", "2", "--batch-size", "16384",
                 "--max-ids-per-partition", "4096", "--dense-params", "1000000", "--out", str(out)]) == 0
    ici, dcn = 2 * 3 / 4 * 4e6 / 600e9, 1e6 / 6.25e9
    plan = load_plan(out)
    assert plan.dense_params == 1_000_000
    assert plan.dense_allreduce_s == pytest.approx(ici + dcn + 3 * 10e-6)
    saved = json.loads(out.read_text())
    assert saved["summary"]["dense_allreduce_s"] == pytest.approx(plan.dense_allreduce_s)
    text = capsys.readouterr().out
    assert "hierarchical: ICI within each slice, DCN across 2 slices" in text
    assert f"DCN {dcn * 1e6:,.1f} us" in text and f"ICI {ici * 1e6:,.1f} us" in text
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--tables", str(DLRM_TABLES), "--topology", "v5p-8", "--dense-params", "-1"])
    assert exit_info.value.code == 2
    assert "argument --dense-params: must be >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d.pop("tables"), "'tables' is a required property (at the top level)"),
    (lambda d: d.update(format="torchrec_tpu.plan/v0"), "(format='torchrec_tpu.plan/v0')"),
    (lambda d: d["tables"][0].update(sharding_type="diagonal"), "(at .tables[0] (table 'C1').sharding_type)"),
    (lambda d: d["devices"][1].update(hbm_bytes=-1), "(at .devices[1].hbm_bytes)"),
])
def test_load_plan_checks_the_json_schema(tmp_path, change, fragment):
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(DLRM_TABLES), "--topology", "v5p-8", "--batch-size", "1024",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    change(data)
    out.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not a (valid )?torchrec_tpu.plan/v1 plan") as info:
        load_plan(out)
    assert fragment in str(info.value)


def test_terminal_table_lists_devices_and_cuts_placements_between_shards(tmp_path, capsys):
    args = ["--tables", str(DLRM_TABLES), "--batch-size", "65536", "--max-ids-per-partition", "2048"]
    assert main(["plan", *args, "--topology", "v5p-64"]) == 0
    text = capsys.readouterr().out
    assert "devices    32: step time" in text and "the 8 slowest" in text and "% of usable)" in text
    placements = [line.split("  ")[-1] for line in text.splitlines() if "column_wise" in line and "dev " in line]
    assert placements and all(p.endswith(("]", "more")) for p in placements), placements
    assert main(["plan", *args, "--topology", "v5p-8", "--batch-size", "4096"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.strip().endswith(" us") and "%" in line]
    assert len(rows) == 4  # every device of a small slice, with its share of the usable HBM
