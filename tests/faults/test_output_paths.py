"""No job writes where it reads: every command refuses, in one line naming both flags and before
it writes anything, an output that is, lies inside or holds one of its inputs (issue 70 item 2:
``--mllog DATA/part-00003.parquet`` replaced a held-out Parquet file with the log)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipelines.output_paths import check_outputs_apart
from tests.faults.checkpoint_helpers import run_copy  # noqa: F401  (a fixture)
from torchrec_tpu.cli import main


def _data(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    for part in range(4):
        (data / f"part-{part:05d}.parquet").write_bytes(b"PAR1 rows of part %d PAR1" % part)
    return data


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(argv: list[str], capsys: pytest.CaptureFixture, *named: str) -> str:
    try:
        rc = main(argv)
    except SystemExit as exit_info:
        rc = exit_info.code
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(errors) == 1, (rc, errors)
    assert all(n in errors[0] for n in named), errors
    return errors[0]


def test_the_mllog_never_replaces_a_data_file(tmp_path, capsys) -> None:
    data = _data(tmp_path)
    before = _snapshot(data)
    line = _refused(["train", "--model", "dlrm_dcn", "--data", str(data), "--mllog", str(data / "part-00003.parquet"),
                     "--log-dir", str(tmp_path / "run")], capsys, "--mllog=", "the input --data=")
    assert line.startswith("torchrec-tpu train: error: ")
    assert _snapshot(data) == before and not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, named", [
    (["--log-dir", "{data}"], "--log-dir='{data}' is the input --data"),
    (["--checkpoint-dir", "{data}/ckpt"], "--checkpoint-dir='{data}/ckpt' lies inside the input --data"),
    (["--mllog", "{tmp}/c.yaml", "--config", "{tmp}/c.yaml"], "--mllog='{tmp}/c.yaml' is the input --config"),
    (["--mllog", "{tmp}/plan.json", "--plan", "{tmp}/plan.json"], "--mllog='{tmp}/plan.json' is the input --plan"),
    (["--mllog", "{tmp}/run/x.txt", "--log-dir", "{tmp}/run/x.txt"], "is also --log-dir"),
    (["--mllog", "{tmp}/ckpt/log.txt", "--resume", "{tmp}/ckpt"], "lies inside the input --resume"),
])
def test_train_refuses_every_output_that_is_an_input(tmp_path, capsys, flags, named) -> None:
    data = _data(tmp_path)
    (tmp_path / "c.yaml").write_text("model: dlrm_dcn\n")
    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "ckpt").mkdir()
    before = _snapshot(tmp_path)
    argv = [f.format(data=data, tmp=tmp_path) for f in ["--model", "dlrm_dcn", "--data", "{data}", *flags]]
    _refused(["train", *argv], capsys, named.format(data=data, tmp=tmp_path))
    assert _snapshot(tmp_path) == before


def test_a_link_to_an_input_is_that_input(tmp_path, capsys) -> None:
    data = _data(tmp_path)
    os.symlink(data / "part-00001.parquet", tmp_path / "link.txt")
    os.link(data / "part-00002.parquet", tmp_path / "hard.txt")
    for out in ("link.txt", "hard.txt"):
        with pytest.raises(ValueError, match="is the input --data"):
            check_outputs_apart([("--mllog", tmp_path / out)], [("--data", data / "part-00001.parquet"),
                                                                  ("--data", data / "part-00002.parquet")])
    check_outputs_apart([("--mllog", tmp_path / "new.txt")], [("--data", data)])  # a path of its own


def test_a_run_may_checkpoint_where_it_resumes_and_log_above_its_data(tmp_path) -> None:
    root = tmp_path / "run" / "checkpoint"
    root.mkdir(parents=True)
    check_outputs_apart([("--log-dir", tmp_path / "run"), ("--checkpoint-dir", root)], [("--resume", root)],
                        may_share={("--checkpoint-dir", "--resume"), ("--log-dir", "--resume"),
                                   ("--checkpoint-dir", "--log-dir")})
    data = _data(tmp_path)
    check_outputs_apart([("--log-dir", tmp_path)], [("--data", data)], may_hold=["--log-dir"])
    with pytest.raises(ValueError, match="holds the input --data"):
        check_outputs_apart([("--output", tmp_path)], [("--data", data)])


def test_profile_and_infer_refuse_an_output_that_is_an_input(tmp_path, capsys) -> None:
    data = _data(tmp_path)
    _refused(["profile", "--data", str(data), "--profile-dir", str(data / "trace")], capsys,
             "--profile-dir=", "lies inside the input --data")
    ckpt = tmp_path / "ckpt"  # what the checkpoint check takes for an HSTU checkpoint
    ckpt.mkdir()
    (ckpt / "meta.json").write_text('{"hstu": {}}')
    _refused(["infer", "--data", str(data), "--checkpoint", str(ckpt), "--output", str(data)], capsys,
             "torchrec-tpu infer: error: --output=", "is the input --data")
    _refused(["infer", "--data", str(data), "--checkpoint", str(ckpt), "--output", str(ckpt / "preds")], capsys,
             "lies inside the input --checkpoint")


def test_data_commands_refuse_an_output_that_is_an_input(tmp_path, capsys) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "day_0.tsv").write_text("1\t2\n")
    before = _snapshot(tmp_path)
    _refused(["data", "convert", str(raw / "day_0.tsv"), "-o", str(raw / "day_0.tsv")], capsys,
             "torchrec-tpu data convert: error: --output=", "is the input input=")
    _refused(["data", "convert", str(raw / "day_0.tsv"), "-o", str(raw)], capsys, "holds the input input=")
    _refused(["data", "sequences", "yambda", str(raw), "-o", str(raw / "seq")], capsys, "lies inside the input")
    assert _snapshot(tmp_path) == before


def test_plan_never_writes_over_its_tables_file(tmp_path, capsys) -> None:
    tables = tmp_path / "tables.yaml"
    tables.write_text("tables:\n  - {name: t, num_embeddings: 1000, embedding_dim: 16}\n")
    before = tables.read_bytes()
    _refused(["plan", "--tables", str(tables), "--out", str(tables)], capsys,
             "torchrec-tpu plan: error: --out=", "is the input --tables")
    _refused(["plan", "--tables", str(tables), "--out", str(tmp_path / "p.json"), "--html", str(tmp_path / "p.json")],
             capsys, "--html=", "is also --out")
    assert tables.read_bytes() == before


def test_export_never_writes_into_its_checkpoint(run_copy, capsys) -> None:
    _, root = run_copy
    before = _snapshot(root)
    _refused(["export", "--checkpoint", str(root), "-o", str(root / "model")], capsys,
             "torchrec-tpu export: error: --output=", "lies inside the input --checkpoint")
    assert _snapshot(root) == before
