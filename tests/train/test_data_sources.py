"""``--data`` sources through the real CLI: the real Criteo sample (with DLRM_DCN), bad sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.train.conftest import SAMPLE_CSV
from torchrec_tpu import cli
from torchrec_tpu.train.checkpoint.store import STATE_DIR
from torchrec_tpu.train.config import ConfigError


def test_sample_data_trains_dlrm_dcn_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert SAMPLE_CSV.is_file(), f"real Criteo sample missing at {SAMPLE_CSV}"
    log_dir = tmp_path / "logs"
    argv = ["train", "--data", "sample", "--model", "dlrm_dcn", "--dcn-num-layers", "2",
            "--dcn-low-rank-dim", "4", "--num-embeddings", "64", "--embedding-dim", "8",
            "--dense-arch", "16,8", "--over-arch", "16,1", "--batch-size", "16", "--epochs", "2",
            "--log-every", "5", "--log-dir", str(log_dir), "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    # 200 rows in 5 files of 40: 160 to train on (10 steps of 16 per epoch), 40 held out. The data
    # runs from a temporary Parquet copy; the lines name 'sample', as typed, not that copy.
    assert "\n  data            sample: 160 train rows in 4 files, 40 held-out rows in 1 file\n" in out, out
    assert "criteo-sample-" not in out
    assert "steps           20 (320 samples this run" in out
    assert "eval AUC" in out and str(log_dir) in out
    meta = json.loads((log_dir / "checkpoint" / "latest" / "meta.json").read_text())
    assert meta["config"]["model"] == "dlrm_dcn" and meta["step"] == 20
    state = torch.distributed.checkpoint.FileSystemReader(
        str(log_dir / "checkpoint" / "latest" / STATE_DIR)).read_metadata().state_dict_metadata
    crossnet = [k for k in state if k.startswith("model.model.inter_arch.crossnet.V_kernels")]
    assert len(crossnet) == 2  # DLRM_DCN with --dcn-num-layers 2, not plain DLRM


def test_an_unknown_source_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    assert cli.main(["train", "--data", str(missing), "--log-dir", str(tmp_path / "l")]) == 2
    assert "is neither 'synthetic', 'sample' nor a directory" in capsys.readouterr().err


def test_resume_from_a_non_checkpoint_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--data", "sample", "--resume", str(tmp_path), "--log-dir",
            str(tmp_path / "l"), "--no-progress"]
    assert cli.main(argv) == 2
    assert f"{tmp_path} is not a checkpoint: expected manifest.json and meta.json inside, or a 'latest' link" in (
        capsys.readouterr().err)


def test_rows_left_out_for_lock_step_are_reported(tiny_dataset: Path) -> None:
    from pipelines.parquet_reader import ParquetBatchReader
    from pipelines.schema import CRITEO
    from torchrec_tpu.train.data import TrainData

    files = sorted(tiny_dataset.glob("*.parquet"))
    reader = lambda paths, drop_last: ParquetBatchReader(paths, 3000, [500] * 26, CRITEO,  # noqa: E731
                                                         rank=0, world_size=2, drop_last=drop_last)
    data = TrainData(tiny_dataset, CRITEO, (500,) * 26, reader(files[:2], True), reader(files[2:], False), 2)
    # Rank 0 of 2 owns 8192 train rows (2 full batches: 2192 left); its 4096 held-out rows are all read.
    assert data.rows_dropped == 2192
    assert "(2,192 training rows left out on this rank to keep ranks in lock-step)" in data.describe()
    assert data.eval_batch_rows == 3000


def test_two_held_out_files_are_a_validation_and_a_test_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_dir = tmp_path / "logs"
    argv = ["train", "--data", "sample", "--eval-files", "2", "--num-embeddings", "64", "--embedding-dim", "8",
            "--dense-arch", "16,8", "--over-arch", "16,1", "--batch-size", "16", "--max-steps", "4",
            "--log-dir", str(log_dir), "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "120 train rows in 3 files, 40 held-out rows in 1 file (validation), 40 test rows in 1 file" in out
    assert "40 samples)" in out.split("eval AUC")[1].splitlines()[0]
    assert "40 samples)" in out.split("test AUC")[1].splitlines()[0]
    metrics = json.loads((log_dir / "checkpoint" / "latest" / "meta.json").read_text())["metrics"]
    assert 0.0 <= metrics["test_auc"] <= 1.0 and metrics["test_loss"] > 0


def test_held_out_files_halve_into_validation_and_test() -> None:
    from torchrec_tpu.train.data import validation_and_test

    assert validation_and_test(["a"]) == (["a"], [])
    assert validation_and_test(["a", "b", "c"]) == (["a", "b"], ["c"])


def _one_file_dataset(tmp_path: Path, copies: int = 10) -> Path:
    """The 200 sample rows ``copies`` times as a headerless Criteo TSV, converted as a new user
    would (`data convert`, its default --rows-per-file): one Parquet file."""
    lines = SAMPLE_CSV.read_text().splitlines()[1:]
    tsv = tmp_path / "day_0.tsv"
    tsv.write_text("".join(line.replace(",", "\t") + "\n" for line in lines * copies))
    assert cli.main(["data", "convert", str(tsv), "-o", str(tmp_path / "parquet"), "--no-progress"]) == 0
    assert len(list((tmp_path / "parquet").glob("*.parquet"))) == 1
    return tmp_path / "parquet"


SMALL_MODEL = ["--num-embeddings", "64", "--embedding-dim", "8", "--dense-arch", "16,8", "--over-arch", "16,1",
               "--batch-size", "64", "--max-steps", "3", "--no-progress"]


@pytest.mark.parametrize("eval_files, held_out", [(1, "200 held-out rows"), (2, "100 held-out rows")])
def test_one_converted_file_trains_holding_out_its_last_rows(tmp_path: Path, capsys, eval_files: int,
                                                             held_out: str) -> None:
    data = _one_file_dataset(tmp_path)
    capsys.readouterr()
    argv = ["train", "--data", str(data), "--eval-files", str(eval_files), "--log-dir", str(tmp_path / "run"),
            *SMALL_MODEL]
    assert cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "too few to hold out" in out and "holding out its last 200 rows instead" in out
    assert "data convert --rows-per-file" in out
    assert f"1,800 train rows (rows 0-1,799 of 1 file), {held_out} (rows 1,800-" in out
    samples = 200 if eval_files == 1 else 100
    assert f"{samples} samples)" in out.split("eval AUC")[1].splitlines()[0]
    if eval_files == 2:
        assert "100 test rows (rows 1,900-1,999 of 1 file)" in out
        assert "100 samples)" in out.split("test AUC")[1].splitlines()[0]


def test_a_row_window_reads_exactly_those_rows_over_the_ranks(tiny_dataset: Path) -> None:
    from pipelines.parquet_reader import ParquetBatchReader
    from pipelines.schema import CRITEO

    files = sorted(tiny_dataset.glob("*.parquet"))

    def labels_and_dense(rows, rank=0, world_size=1) -> torch.Tensor:
        reader = ParquetBatchReader(files, 1000, [500] * 26, CRITEO, rank=rank, world_size=world_size, rows=rows)
        return torch.cat([torch.cat([b.labels[:, None], b.dense_features], 1) for b in reader])

    everything = labels_and_dense(None)
    assert torch.equal(labels_and_dense((5000, 20000)), everything[5000:20000])  # across a file boundary
    ranks = torch.cat([labels_and_dense((5000, 20001), rank, 3) for rank in range(3)])
    assert torch.equal(ranks, everything[5000:20001])
    with pytest.raises(ValueError, match="not within the 24576 rows"):
        ParquetBatchReader(files, 1000, [500] * 26, CRITEO, rank=0, world_size=1, rows=(0, 24577))


def test_too_few_files_for_ray_name_data_convert(tmp_path: Path) -> None:
    from torchrec_tpu.train.data import split_files

    with pytest.raises(ConfigError, match=r"at least 2 \(write more, smaller files: `torchrec-tpu data convert "
                                          r"--rows-per-file N`\)"):
        split_files([tmp_path / "a.parquet"], 1, tmp_path)
