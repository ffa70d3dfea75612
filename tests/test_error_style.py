"""One error style across subcommands: ``torchrec-tpu CMD: error: ...`` naming the CLI flag, exit 2."""

from __future__ import annotations

import pytest

from torchrec_tpu.cli import main


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
    assert lines[0].startswith(f"torchrec-tpu {command}: error: ") and fragment in lines[0], lines[0]
