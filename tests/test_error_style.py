"""One error style across subcommands: ``torchrec-tpu CMD: error: ...`` naming the CLI flag, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.synthetic import SyntheticConfig, generate
from torchrec_tpu.cli import main

REPO_ROOT = Path(__file__).resolve().parents[1]


def _bad_row_file(tmp_path):
    path = tmp_path / "day_0.tsv"
    path.write_text("1\t2\tx\n")
    return str(path)


def _bad_tables_file(tmp_path):
    path = tmp_path / "tables.yaml"
    path.write_text("- {name: a, rows: 10}\n")
    return str(path)


CASES = [
    ("train", lambda tmp: ["train", "--batch-size", "0", "--log-dir", str(tmp / "run")], "--batch-size"),
    ("profile", lambda tmp: ["profile", "--embedding-dim", "8", "--log-dir", str(tmp / "run")], "--embedding-dim"),
    ("plan", lambda tmp: ["plan", "--tables", _bad_tables_file(tmp)], "missing required keys"),
    ("plan", lambda tmp: ["plan", "--tables", _bad_tables_file(tmp), "--batch-size", "0"], "argument --batch-size"),
    ("data convert", lambda tmp: ["data", "convert", _bad_row_file(tmp), "-o", str(tmp / "o"), "--no-progress"],
     "--on-bad-row skip"),
    ("data generate", lambda tmp: ["data", "generate", "-o", str(tmp / "o"), "--multi-hot", "I1"], "--multi-hot I1"),
    ("infer", lambda tmp: ["infer", "--data", str(tmp), "--checkpoint", str(tmp / "none"), "--output",
                           str(tmp / "o")], "not a checkpoint"),
    ("infer", lambda tmp: ["infer", "--data", str(tmp), "--checkpoint", str(tmp), "--output", str(tmp / "o"),
                           "--concurrency", "0"], "argument --concurrency"),
]


@pytest.mark.parametrize("command, argv, fragment", CASES, ids=[f"{c}-{f}" for c, _, f in CASES])
def test_user_error_is_one_line_naming_the_flag_and_exits_2(command, argv, fragment, tmp_path, capsys):
    try:
        rc = main(argv(tmp_path))
    except SystemExit as exit_info:  # argparse's own flag errors
        rc = exit_info.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "full traceback" not in err, err  # a plain user error: the line says it all
    assert lines[0].startswith(f"torchrec-tpu {command}: error: ") and fragment in lines[0], lines[0]


def _no_parquet(tmp):
    (tmp / "empty").mkdir()
    return str(tmp / "empty")


# (argv, fragment of the error) of user errors found before torch, jax or ray is imported
EARLY = [
    (lambda tmp: ["train", "--data", str(tmp / "nope")], "--data='"),
    (lambda tmp: ["train", "--data", _no_parquet(tmp)], "holds no .parquet files"),
    (lambda tmp: ["train", "--resume", str(tmp / "nope")], "is not a checkpoint"),
    (lambda tmp: ["train", "--plan", str(tmp / "nope.json")], "--plan='"),
    (lambda tmp: ["train", "--in-memory-binary-criteo-path", str(tmp / "nope")], "no such directory"),
    (lambda tmp: ["profile", "--data", str(tmp / "nope")], "--data='"),
    (lambda tmp: ["infer", "--data", _no_parquet(tmp), "--checkpoint", str(tmp / "none"), "--output",
                  str(tmp / "o")], "not a checkpoint"),
]


@pytest.mark.parametrize("argv, fragment", EARLY, ids=[str(i) for i in range(len(EARLY))])
def test_a_missing_input_fails_before_the_heavy_imports_and_leaves_no_run_dir(argv, fragment, tmp_path):
    """In a fresh process (the test process has torch loaded already): the error line comes
    without torch, jax or ray imported (each costs seconds), and no runs/<timestamp>/ appears."""
    script = ("import sys; from torchrec_tpu.cli import main; rc = main(sys.argv[1:]); "
              "print(rc, sorted(m for m in ('torch', 'jax', 'ray') if m in sys.modules))")
    work = tmp_path / "cwd"
    work.mkdir()
    done = subprocess.run([sys.executable, "-c", script, *argv(tmp_path)], capture_output=True, text=True,
                          cwd=work, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120)
    assert done.stdout.split("\n")[0] == "2 []", done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and fragment in lines[0] and ": error: " in lines[0], done.stderr
    assert not (work / "runs").exists()


def test_a_run_failing_on_its_config_inside_the_job_leaves_no_run_dir(tmp_path, monkeypatch, capsys):
    """A config error found only once the data is open (a table count that does not match the
    data's features): rc 2, and no runs/<timestamp>/ for TensorBoard to list."""
    data = tmp_path / "data"
    generate(SyntheticConfig(num_rows=512, seed=1, max_cardinality=50, rows_per_file=256, row_group_size=128),
             data, progress=False)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--data", str(data), "--num-embeddings-per-feature", "5,5", "--no-progress"]) == 2
    assert "--num-embeddings-per-feature='5,5' has 2 values" in capsys.readouterr().err
    assert not list((tmp_path / "runs").glob("*"))
