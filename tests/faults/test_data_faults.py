"""`data convert` is atomic: a killed or failed run leaves no dataset that a reader takes for a
complete one, a full disk leaves no ``.tmp`` part, readers refuse incomplete or altered datasets."""

from __future__ import annotations

import gzip
import json
import resource
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipelines.convert import convert_to_parquet
from pipelines.dataset_dir import COMPLETE_MARKER, INCOMPLETE_MARKER, IncompleteDatasetError
from pipelines.parquet_reader import ParquetBatchReader, list_parquet_files
from pipelines.schema import CRITEO
from pipelines.text_blocks import LineTooLongError
from pipelines.text_reader import BadRowError
from tests.faults.helpers import assert_clean_error, cli_command, cli_env, sample_tsv_lines, write_sample_tsv
from torchrec_tpu.cli import main

SIZES = (100,) * len(CRITEO.sparse)


def _staging_dirs(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.incomplete-*"))


def _all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_convert_publishes_marker_with_row_counts(tmp_path):
    source = write_sample_tsv(tmp_path / "day.tsv")
    report = convert_to_parquet([source], tmp_path / "out", rows_per_file=64, progress=False)
    marker = json.loads((tmp_path / "out" / COMPLETE_MARKER).read_text())
    by_footer = {p.name: pq.read_metadata(p).num_rows for p in (tmp_path / "out").glob("*.parquet")}
    assert marker["files"] == by_footer == {"part-00000.parquet": 64, "part-00001.parquet": 64,
                                            "part-00002.parquet": 64, "part-00003.parquet": 8}
    assert marker["rows"] == 200 == report.rows_written
    assert not (tmp_path / "out" / INCOMPLETE_MARKER).exists()
    assert report.files == sorted((tmp_path / "out").glob("*.parquet"))
    assert _staging_dirs(tmp_path, "out") == []


def test_killed_convert_leaves_no_dataset_and_readers_refuse_its_staging(tmp_path, capsys):
    source = write_sample_tsv(tmp_path / "big.tsv", repeat=250)  # 50k rows, 50 parts of 1000
    out = tmp_path / "out"
    proc = subprocess.Popen(
        cli_command("data", "convert", str(source), "-o", str(out), "--rows-per-file", "1000",
                    "--row-group-size", "1000", "--no-progress"),
        env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    staged_parts: list[Path] = []
    while not staged_parts and time.monotonic() < deadline and proc.poll() is None:
        staged_parts = [p for d in _staging_dirs(tmp_path, "out") for p in d.glob("part-*.parquet")]
        time.sleep(0.02)
    assert staged_parts and proc.poll() is None, "convert finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not out.exists(), "a killed convert must not leave a dataset at --output"
    (staging,) = _staging_dirs(tmp_path, "out")
    assert (staging / INCOMPLETE_MARKER).is_file()
    with pytest.raises(IncompleteDatasetError, match="incomplete dataset"):
        ParquetBatchReader(staging, 16, SIZES)
    rc = main(["train", "--data", str(staging), "--no-progress", "--log-dir", str(tmp_path / "run")])
    assert_clean_error(rc, capsys.readouterr().err, str(staging), "incomplete dataset")
    # The next run into the same output removes the dead run's staging directory.
    small = write_sample_tsv(tmp_path / "small.tsv")
    convert_to_parquet([small], out, progress=False)
    assert _staging_dirs(tmp_path, "out") == []
    assert ParquetBatchReader(out, 16, SIZES).num_rows == 200


def test_full_disk_is_a_clean_error_leaving_no_tmp_part(tmp_path):
    """A real write failure: the file size limit (RLIMIT_FSIZE) makes writes fail with EFBIG."""
    source = write_sample_tsv(tmp_path / "day.tsv", repeat=20)  # 4000 rows, Parquet far over 8 KB
    work = tmp_path / "work"
    work.mkdir()

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8_000, 8_000))

    result = subprocess.run(
        cli_command("data", "convert", str(source), "-o", str(work / "out"), "--no-progress"),
        env=cli_env(), capture_output=True, text=True, timeout=120, preexec_fn=limit_file_size,
    )
    assert_clean_error(result.returncode, result.stderr, "File too large", str(work / "out"))
    assert _all_files(work) == [], "no output, no staging directory, no .tmp part"


@pytest.mark.parametrize("damage", ["missing", "extra", "truncated", "bad_marker"])
def test_readers_refuse_a_dataset_that_disagrees_with_its_marker(tmp_path, damage):
    source = write_sample_tsv(tmp_path / "day.tsv")
    out = tmp_path / "out"
    convert_to_parquet([source], out, rows_per_file=64, progress=False)
    part = out / "part-00001.parquet"
    if damage == "missing":
        part.unlink()
        expected = "missing ['part-00001.parquet']"
    elif damage == "extra":
        (out / "part-00009.parquet").write_bytes((out / "part-00000.parquet").read_bytes())
        expected = "not listed ['part-00009.parquet']"
    elif damage == "truncated":
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
        expected = f"{part}: not a readable Parquet file"
    else:
        (out / COMPLETE_MARKER).write_text('{"files": [1, 2')
        expected = "unreadable completion marker"
    with pytest.raises(IncompleteDatasetError) as error:
        list_parquet_files(out)
    assert expected in str(error.value)


def test_row_count_disagreeing_with_marker_is_refused(tmp_path):
    source = write_sample_tsv(tmp_path / "day.tsv")
    out = tmp_path / "out"
    convert_to_parquet([source], out, rows_per_file=64, progress=False)
    fewer = pq.read_table(out / "part-00002.parquet").slice(0, 10)
    pq.write_table(fewer, out / "part-00002.parquet")
    with pytest.raises(IncompleteDatasetError, match=r"part-00002.parquet holds 10 rows but .* records 64"):
        ParquetBatchReader(out, 16, SIZES)


def test_output_must_be_new_or_empty(tmp_path):
    source = write_sample_tsv(tmp_path / "day.tsv")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not empty"):
        convert_to_parquet([source], tmp_path / "busy", progress=False)
    assert _all_files(tmp_path / "busy") == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    convert_to_parquet([source], tmp_path / "empty", progress=False)
    assert (tmp_path / "empty" / COMPLETE_MARKER).is_file()


def _one_long_line_gz(path: Path, megabytes: int) -> Path:
    """A .gz of one line of ``megabytes`` MiB (about 1 KiB of .gz per MiB)."""
    with gzip.open(path, "wb", compresslevel=9) as out:
        out.write(b"1\t")
        for _ in range(megabytes):
            out.write(b"x" * (1 << 20))
        out.write(b"\n")
    return path


def test_convert_of_a_line_longer_than_the_limit_exits_at_once(tmp_path):
    # Arrow's CSV reader used to decompress and transcode in its read-ahead thread; leaving after
    # the error deadlocked at exit (or crashed). Now one error line naming the flag, then exit.
    source = _one_long_line_gz(tmp_path / "day.tsv.gz", 300)
    started = time.monotonic()
    done = subprocess.run(cli_command("data", "convert", str(source), "-o", str(tmp_path / "out"),
                                      "--no-progress"),
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 60
    assert_clean_error(done.returncode, done.stderr, f"{source}:1", "line longer than 67108864 bytes",
                       "--max-line-bytes")
    assert not (tmp_path / "out").exists()


def test_lines_longer_than_the_read_block_are_read_whole(tmp_path):
    lines = sample_tsv_lines()
    source = tmp_path / "day.tsv.gz"
    source.write_bytes(gzip.compress(("\n".join(lines[:20]) + "\n1\t" + "7" * 100_000 + "\n").encode()))
    with pytest.raises(BadRowError, match=rf"{source}:21: expected 40 columns, got 2"):
        convert_to_parquet([source], tmp_path / "bad", block_size=1024, progress=False)
    report = convert_to_parquet([source], tmp_path / "skip", block_size=1024, progress=False,
                                on_bad_row="skip")
    assert (report.rows_written, report.rows_skipped) == (20, 1)
    with pytest.raises(LineTooLongError, match=rf"{source}:21: line longer than 50000 bytes"):
        convert_to_parquet([source], tmp_path / "cap", block_size=1024, progress=False,
                           max_line_bytes=50_000)
