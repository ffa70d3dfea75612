"""User errors end in one ``error:`` line and rc 1/2, never a traceback or an abort.

Most cases call the CLI's ``main`` in this process (what the console script runs, minus the
interpreter start); the ones about aborts run a real process.
"""

from __future__ import annotations

import gzip
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.faults.conftest import TRAIN_FLAGS
from tests.faults.helpers import assert_clean_error, run_cli, sample_tsv_lines
from torchrec_tpu.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _train(capsys, data: Path | str, tmp_path: Path, *extra: str) -> tuple[int, str]:
    rc, _, err = _run(capsys, "train", "--data", str(data), *TRAIN_FLAGS,
                      "--log-dir", str(tmp_path / "run"), *extra)
    return rc, err


# --- train: options and option files ------------------------------------------------------------

def test_batch_size_not_divisible_by_sparsecores_is_padded(capsys, tiny_dataset, tmp_path):
    """As TorchRec takes any batch size, the sparsecore EBC pads a batch of 1 to its 4 SparseCores."""
    rc, err = _train(capsys, tiny_dataset, tmp_path, "--batch-size", "1")
    assert rc == 0, err


@pytest.mark.parametrize("content, fragment", [
    ("[1, 2, 3]", "a plan JSON holds an object, got a list"),
    ('{"format": "torchrec-tpu-pl', "malformed JSON"),
    ("\x00\xff\xfe garbage", "not a JSON text file"),
])
def test_bad_plan_file(capsys, tiny_dataset, tmp_path, content, fragment):
    plan = tmp_path / "plan.json"
    plan.write_bytes(content.encode("latin-1"))
    rc, err = _train(capsys, tiny_dataset, tmp_path, "--plan", str(plan))
    assert_clean_error(rc, err, str(plan), fragment)


def test_malformed_train_yaml(capsys, tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("batch_size: [1, 2\nmodel: :\n")
    rc, _, err = _run(capsys, "train", "--config", str(config))
    assert_clean_error(rc, err, str(config), "malformed YAML", "line 1")


def test_yaml_errors_name_the_file_and_line_on_one_line(capsys, tmp_path):
    """PyYAML's multi-line message, whose marks name "<unicode string>", becomes one line naming
    the file, the line and column of the problem, and the construct it was in."""
    config = tmp_path / "train.yaml"
    config.write_text("batch_size: 64\nlayers: [1, 2\nmodel: dlrm\n")
    rc, _, err = _run(capsys, "train", "--config", str(config))
    assert rc == 2 and "<unicode string>" not in err
    assert err.strip().splitlines() == [
        f"torchrec-tpu train: error: --config={str(config)!r}: {config}: malformed YAML at line 3, column 6: "
        "expected ',' or ']', but got ':' (while parsing a flow sequence from line 2)"]


def test_log_dir_that_is_a_file(capsys, tiny_dataset, tmp_path):
    log_file = tmp_path / "log"
    log_file.write_text("not a directory")
    rc, _, err = _run(capsys, "train", "--data", str(tiny_dataset), *TRAIN_FLAGS, "--log-dir", str(log_file))
    assert_clean_error(rc, err, f"--log-dir={str(log_file)!r} is a file")


# --- train: Parquet inputs ----------------------------------------------------------------------

def _rewrite(path: Path, change) -> None:
    pq.write_table(change(pq.read_table(path)), path)


@pytest.mark.parametrize("damage, fragment", [
    ("corrupt", "part-00001.parquet: not a readable Parquet file"),
    ("truncated", "part-00001.parquet: not a readable Parquet file"),
    ("missing_column", "part-00001.parquet: columns ['I5'] of the schema are missing"),
    ("string_column", "part-00001.parquet: column I2 must be numeric, got string"),
    ("string_ids", "part-00001.parquet: column C3 must be integer ids or list<integer>, got string"),
    ("zero_rows_held_out", "the held-out files ['part-00003.parquet'] hold no rows"),
])
def test_bad_parquet_inputs(capsys, tiny_copy, tmp_path, damage, fragment):
    part = tiny_copy / "part-00001.parquet"
    if damage == "corrupt":
        part.write_bytes(b"PAR1" + os.urandom(3000))
    elif damage == "truncated":
        part.write_bytes(part.read_bytes()[:-100])
    elif damage == "missing_column":
        _rewrite(part, lambda t: t.drop(["I5"]))
    elif damage in ("string_column", "string_ids"):
        name = "I2" if damage == "string_column" else "C3"
        _rewrite(part, lambda t: t.set_column(t.schema.get_field_index(name), name,
                                              t.column(name).cast(pa.string())))
    else:
        _rewrite(tiny_copy / "part-00003.parquet", lambda t: t.slice(0, 0))
    rc, err = _train(capsys, tiny_copy, tmp_path)
    assert_clean_error(rc, err, fragment)


def test_zero_row_file_among_others_trains(capsys, tiny_copy, tmp_path):
    _rewrite(tiny_copy / "part-00001.parquet", lambda t: t.slice(0, 0))
    rc, out = _run(capsys, "train", "--data", str(tiny_copy), *TRAIN_FLAGS, "--log-dir", str(tmp_path / "r"))[:2]
    assert rc == 0 and "512 train rows in 3 files" in out


# --- plan ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, content, fragment", [
    ("tables.json", '{"tables": [{"name": "t0", "rows": 100', "malformed JSON"),
    ("tables.yaml", "tables:\n  - name: t0\n    rows: [1,\n", "malformed YAML"),
    ("tables.yaml", "\x89PNG\x00\xff", "not a YAML text file"),
])
def test_bad_tables_file(capsys, tmp_path, name, content, fragment):
    path = tmp_path / name
    path.write_bytes(content.encode("latin-1"))
    rc, _, err = _run(capsys, "plan", "--tables", str(path))
    assert_clean_error(rc, err, str(path), fragment)


def test_plan_out_into_a_missing_directory_creates_it(capsys, tmp_path):
    tables = tmp_path / "tables.json"
    tables.write_text('[{"name": "t0", "rows": 1000, "dim": 16}, {"name": "t1", "rows": 50, "dim": 16}]')
    out = tmp_path / "new" / "dir" / "plan.json"
    rc, stdout, err = _run(capsys, "plan", "--tables", str(tables), "--topology", "v5p-8", "--out", str(out))
    assert rc == 0, err
    assert out.is_file() and f"wrote plan {out}" in stdout


# --- data convert: text inputs ------------------------------------------------------------------

def test_empty_gz_names_the_file(capsys, tmp_path):
    empty = tmp_path / "day.tsv.gz"
    empty.write_bytes(b"")
    rc, _, err = _run(capsys, "data", "convert", str(empty), "-o", str(tmp_path / "out"), "--no-progress")
    assert_clean_error(rc, err, str(empty), "cannot read it as gzip-compressed TSV")
    assert not (tmp_path / "out").exists()


def test_truncated_gz_names_the_file(capsys, tmp_path):
    whole = gzip.compress("\n".join(sample_tsv_lines()).encode())
    truncated = tmp_path / "day.tsv.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    for policy in ("error", "skip"):
        rc, _, err = _run(capsys, "data", "convert", str(truncated), "-o", str(tmp_path / policy),
                          "--no-progress", "--on-bad-row", policy)
        assert_clean_error(rc, err, str(truncated), "Truncated compressed stream")
        assert not (tmp_path / policy).exists()


def _non_utf8_csv(path: Path) -> Path:
    lines = ["label," + ",".join([f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)])]
    lines += [line.replace("\t", ",") for line in sample_tsv_lines()]
    data = "\n".join(lines).encode()
    first_id = data.index(b"05db9164")  # row 1 (line 2), column C1
    path.write_bytes(data[:first_id] + b"05db\xe9\xff64" + data[first_id + 8:] + b"\n")
    return path


def test_non_utf8_csv_is_a_bad_row(capsys, tmp_path):
    csv = _non_utf8_csv(tmp_path / "day.csv")
    rc, _, err = _run(capsys, "data", "convert", str(csv), "-o", str(tmp_path / "strict"), "--no-progress")
    assert_clean_error(rc, err, f"{csv}:2: column C1: not valid UTF-8")
    rc, out, err = _run(capsys, "data", "convert", str(csv), "-o", str(tmp_path / "skip"), "--no-progress",
                        "--on-bad-row", "skip")
    assert rc == 0, err
    assert "read 200 rows, wrote 199" in out and "skipped 1 malformed rows" in out
    assert f"skipped {csv}:2: column C1: not valid UTF-8" in out
    assert pq.read_metadata(tmp_path / "skip" / "part-00000.parquet").num_rows == 199


def test_binary_garbage_never_aborts_and_lists_skips_with_a_tail(tmp_path):
    """A real process over several kinds of garbage: skip policy counts them, the list of skipped
    rows ends in '... and N more'; the error policy stops with one error line."""
    rng = random.Random(0)
    garbage = []
    for i, suffix in enumerate((".tsv", ".csv", ".tsv.gz")):
        blob = bytes(rng.getrandbits(8) for _ in range(20_000))
        path = tmp_path / f"garbage{i}{suffix}"
        path.write_bytes(gzip.compress(blob) if suffix.endswith(".gz") else blob)
        garbage.append(path)
    mixed = tmp_path / "mixed.tsv"  # sample rows with random binary lines between them
    lines = sample_tsv_lines()
    def garbage_line() -> bytes:
        return bytes(rng.getrandbits(8) for _ in range(80)).replace(b"\n", b" ")

    mixed.write_bytes(b"\n".join(line.encode() if k % 3 else garbage_line() for k, line in enumerate(lines)) + b"\n")
    skip = run_cli("data", "convert", str(mixed), str(garbage[0]), str(garbage[2]), "-o", str(tmp_path / "skip"),
                   "--no-progress", "--on-bad-row", "skip")
    assert skip.returncode == 0, skip.stderr[-2000:]
    assert "Traceback" not in skip.stderr
    listed = [line for line in skip.stdout.splitlines() if line.startswith("  skipped ")]
    summary = skip.stdout.splitlines()[0]
    skipped = int(summary.split("skipped ")[1].split()[0])
    assert skipped > len(listed) > 0
    assert skip.stdout.rstrip().endswith(f"... and {skipped - len(listed)} more")
    for path in garbage:
        strict = run_cli("data", "convert", str(path), "-o", str(tmp_path / f"strict-{path.name}"), "--no-progress")
        assert_clean_error(strict.returncode, strict.stderr, str(path))


def test_infer_output_that_is_a_file(capsys, tiny_dataset, tmp_path_factory, tmp_path):
    from tests.faults.checkpoint_helpers import shared_run

    _, root = shared_run(tmp_path_factory)
    output = tmp_path / "predictions"
    output.write_text("not a directory")
    rc, _, err = _run(capsys, "infer", "--data", str(tiny_dataset), "--checkpoint", str(root),
                      "--output", str(output), "--no-progress")
    assert_clean_error(rc, err, f"--output={str(output)!r} is a file")
