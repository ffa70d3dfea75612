"""`train --resume` compares the run with the checkpoint: the data position is in rows (a new
batch size resumes at the saved row), and anything that cannot continue the saved state exactly
(tables, dims, optimizers, data, world size, a rank's RNG state) is one clear error naming the
saved and the requested value, raised before any model is built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from pipelines.parquet_reader import ParquetBatchReader
from pipelines.streams import batches_from_row
from tests.faults.checkpoint_helpers import BATCH, SAVED_STEPS, reseal, run_cli, run_copy, train_args, versions  # noqa: F401
from torchrec_tpu import cli

TRAIN_ROWS = 1024  # the shared run's data: 2 files of 512 rows to train on


def test_a_different_batch_size_resumes_at_the_saved_row(run_copy, tmp_path: Path) -> None:
    data, root = run_copy
    latest = versions(root)[-1]
    saved_rows = SAVED_STEPS[-1] * BATCH  # 256
    done = run_cli(*train_args(data, tmp_path / "resumed", "--batch-size", str(2 * BATCH), "--resume", str(root),
                               "--checkpoint-dir", str(tmp_path / "out")))
    assert done.returncode == 0, done.stderr
    assert (f"resuming from {latest}: step {SAVED_STEPS[-1]}, epoch 0, {saved_rows:,} rows of the epoch "
            "already trained") in done.stdout, done.stdout
    # the rest of the epoch, rows 256..1023, in batches of 128: 6 steps (a batch count would
    # have skipped to row 4 x 128 = 512 and trained 4)
    rest = TRAIN_ROWS - saved_rows
    steps = SAVED_STEPS[-1] + rest // (2 * BATCH)
    assert f"steps           {steps} ({rest:,} samples this run" in done.stdout, done.stdout
    final = json.loads((tmp_path / "out" / "latest" / "meta.json").read_text())
    assert (final["step"], final["epoch"], final["rank_rows"], final["rows"]) == (steps, 0, TRAIN_ROWS, TRAIN_ROWS)


def test_row_seeking_yields_exactly_the_rows_after_the_position(run_copy) -> None:
    data, _ = run_copy
    files = sorted(data.glob("*.parquet"))[:2]
    labels = torch.cat([torch.from_numpy(pq.read_table(f, columns=["label"]).column(0).to_numpy()) for f in files])
    reader = ParquetBatchReader(files, 96, (100,) * 26)
    for row in (0, 100, 512, 1000, TRAIN_ROWS, TRAIN_ROWS + 5):
        batches = list(reader.iter_from_row(row))
        got = torch.cat([b.labels for b in batches]) if batches else torch.zeros(0)
        torch.testing.assert_close(got, labels[row:].to(got.dtype), rtol=0, atol=0)
        assert all(b.labels.numel() == 96 for b in batches[:-1])
    listed = list(ParquetBatchReader(files, 64, (100,) * 26))  # a stream without seeking
    assert len(list(batches_from_row(iter(listed), 128))) == len(listed) - 2
    with pytest.raises(ValueError, match="row 100 falls inside a batch .rows 64-127."):
        list(batches_from_row(iter(listed), 100))


def _resume_in_process(data: Path, root: Path, tmp_path: Path, capsys, *flags: str) -> str:
    """The one error line of `train --resume` (run in this process: it fails before any model
    is built)."""
    code = cli.main(train_args(data, tmp_path / "resumed", "--batch-size", str(BATCH), "--resume", str(root), *flags))
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = [line for line in err.splitlines() if ": error: " in line]
    return line


@pytest.mark.parametrize("flags,expected", [
    (["--sparse-optimizer", "sgd"], "--sparse-optimizer is 'adagrad' in the checkpoint, 'sgd' now"),
    (["--dense-optimizer", "adam"], "--dense-optimizer is 'adagrad' in the checkpoint, 'adam' now"),
    (["--embedding-dim", "16", "--dense-arch", "16,16"],
     "--embedding-dim is 8 in the checkpoint, 16 now; --dense-arch is '16,8' in the checkpoint, '16,16' now"),
    (["--engine", "torchrec"], "--engine is 'sparsecore' in the checkpoint, 'torchrec' now"),
    (["--num-embeddings", "50"], "its tables have [100, 100,"),
])
def test_a_state_mismatch_names_the_saved_and_requested_values(flags, expected, run_copy, tmp_path: Path,
                                                               capsys) -> None:
    data, root = run_copy
    error = _resume_in_process(data, root, tmp_path, capsys, *flags)
    assert f"cannot resume {versions(root)[-1]} exactly: " in error and expected in error, error


def test_other_training_data_is_refused(run_copy, tmp_path: Path, capsys) -> None:
    data, root = run_copy
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    for f in sorted(data.glob("*.parquet"))[1:]:  # one training file less
        shutil.copy(f, fewer / f.name)
    error = _resume_in_process(fewer, root, tmp_path, capsys)
    assert f"it trained on {TRAIN_ROWS} rows, --data='{fewer}' has 512 to train on" in error, error


def test_another_world_size_is_refused(run_copy, tmp_path: Path, capsys) -> None:
    data, root = run_copy
    latest = versions(root)[-1]
    meta = json.loads((latest / "meta.json").read_text())
    (latest / "meta.json").write_text(json.dumps({**meta, "world_size": 2}))
    reseal(latest)
    error = _resume_in_process(data, root, tmp_path, capsys)
    assert "it was written by 2 rank(s), this run has 1" in error, error


def test_a_position_past_the_data_says_so(run_copy, tmp_path: Path, capsys) -> None:
    data, root = run_copy
    latest = versions(root)[-1]
    meta = json.loads((latest / "meta.json").read_text())
    (latest / "meta.json").write_text(json.dumps({**meta, "rank_rows": 5000, "rows": 5000}))
    reseal(latest)
    error = _resume_in_process(data, root, tmp_path, capsys)
    assert (f"checkpoint {latest}: its data position, 5,000 rows into epoch 0 on each rank, is past the training "
            f"data: --data='{data}' has {TRAIN_ROWS:,} rows to train on, at most {TRAIN_ROWS:,} per rank over 1 "
            "rank(s)") in error, error


def test_a_missing_rng_file_is_an_error(run_copy, tmp_path: Path, capsys) -> None:
    data, root = run_copy
    latest = versions(root)[-1]
    (latest / "rng" / "rank-00000.pt").unlink()
    reseal(latest)  # not a corruption: the checkpoint was saved without it
    error = _resume_in_process(data, latest, tmp_path, capsys)
    assert f"checkpoint {latest} has no RNG state for rank 0 (rng/rank-00000.pt)" in error, error


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_rank_fails_promptly_with_the_same_error(run_copy, tmp_path: Path) -> None:
    """The checkpoint is checked on rank 0 and its verdict broadcast: no rank is left waiting."""
    from tests.train.cli_ranks import start_cli_ranks

    data, root = run_copy
    ranks = start_cli_ranks(train_args(data, tmp_path / "resumed", "--batch-size", str(BATCH), "--resume",
                                       str(root)), tmp_path, world=2)
    try:
        codes = [proc.wait(timeout=180) for proc, _ in ranks]
    finally:
        for proc, _ in ranks:
            if proc.poll() is None:
                proc.kill()
    outs = [out.read_text() for _, out in ranks]
    assert codes == [2, 2], outs
    errors = [[line for line in out.splitlines() if ": error: " in line] for out in outs]
    (line,) = errors[0] + errors[1]  # said once, by the first rank to fail
    assert "it was written by 1 rank(s), this run has 2" in line


def test_the_resume_line_names_the_checkpoint_as_typed(run_copy, tmp_path: Path, capsys,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``--resume`` given relative to the working directory (a root: its ``latest`` is followed):
    the resume line names the version under the path as typed, not its absolute target. (The CLI
    runs in this process: a fresh one would spend most of the test importing.)"""
    import os

    from tests.faults.checkpoint_helpers import REPO_ROOT

    data, root = run_copy
    monkeypatch.chdir(REPO_ROOT)
    typed = os.path.relpath(root, REPO_ROOT)
    code = cli.main(train_args(data, tmp_path / "resumed", "--batch-size", str(BATCH), "--resume", typed,
                               "--max-steps", str(SAVED_STEPS[-1] + 1), "--checkpoint-dir", str(tmp_path / "out")))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"resuming from {typed}/{versions(root)[-1].name}: step {SAVED_STEPS[-1]}," in out, out
