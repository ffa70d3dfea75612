"""Bad labels and non-finite dense values: one policy (--bad-values error|skip|clamp) in the
training reader and in inference, checked against hand-computed values from the files. Nothing
aborts: the default is one error line naming file, row and column."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.arrow_batch import dense_transform
from pipelines.bad_value_policies import POLICIES
from pipelines.bad_values import FLOAT32_MAX, BadValueError
from pipelines.parquet_reader import ParquetBatchReader
from pipelines.schema import CRITEO
from tests.faults.checkpoint_helpers import shared_run
from tests.faults.conftest import TRAIN_FLAGS
from tests.faults.helpers import assert_clean_error
from torchrec_tpu.cli import main
from torchrec_tpu.inference.job import InferenceConfig, Predictor
from torchrec_tpu.inference.units import Unit, claim_output_dir, plan_units
from torchrec_tpu.train.config import BAD_VALUE_POLICIES

SIZES = (100,) * len(CRITEO.sparse)
PART = "part-00001.parquet"  # rows 256-511 of the tiny dataset's 1024
ROW = 10  # row of PART that gets the bad value


def _damage(data: Path, column: str, value: float, part: str = PART, row: int = ROW) -> Path:
    """``column`` of ``part`` as float64 with ``value`` at ``row``; the other files keep their
    types (a label int8 in one file and float64 in another must still batch together)."""
    path = data / part
    table = pq.read_table(path)
    values = table.column(column).to_numpy().astype(np.float64)
    values[row] = value
    pq.write_table(table.set_column(table.schema.get_field_index(column), column, pa.array(values)), path)
    return path


def _all_rows(data: Path, policy: str, batch_size: int = 64, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """(labels, dense) of every batch the reader yields, concatenated."""
    reader = ParquetBatchReader(data, batch_size, SIZES, bad_values=policy, prefetch_row_groups=0, **kwargs)
    batches = list(reader)
    return (np.concatenate([b.labels.numpy() for b in batches]),
            np.concatenate([b.dense_features.numpy() for b in batches]))


def _reference(data: Path) -> tuple[np.ndarray, np.ndarray]:
    """Labels and transformed dense values straight from the files, by hand."""
    tables = [pq.read_table(p) for p in sorted(data.glob("*.parquet"))]
    labels = np.concatenate([t.column("label").to_numpy().astype(np.float32) for t in tables])
    dense = np.stack([np.concatenate([t.column(c).fill_null(0).to_numpy().astype(np.float64) for t in tables])
                      for c in CRITEO.dense], axis=1)
    return labels, dense_transform(dense)


BAD = [("label", 7.0, "7.0 is not a label in [0, 1]"), ("label", -3.0, "-3.0 is not a label in [0, 1]"),
       ("label", np.nan, "nan is not a label in [0, 1]"), ("I3", np.inf, "inf is beyond float32's range"),
       ("I3", 1e300, "1e+300 is beyond float32's range"), ("I7", -np.inf, "-inf is beyond float32's range")]


@pytest.mark.parametrize("column, value, why", BAD)
def test_reader_policies_against_hand_values(tiny_copy, column, value, why):
    path = _damage(tiny_copy, column, value)
    with pytest.raises(BadValueError) as error:
        _all_rows(tiny_copy, "error")
    assert f"{path}: row {ROW}, column {column}: {why}" in str(error.value)
    assert "--bad-values skip or clamp" in str(error.value)

    global_row = 256 + ROW
    labels, dense = _reference(tiny_copy)
    keep = np.arange(len(labels)) != global_row
    got_labels, got_dense = _all_rows(tiny_copy, "skip")
    np.testing.assert_array_equal(got_labels, labels[keep])
    np.testing.assert_array_equal(got_dense, dense[keep])

    got_labels, got_dense = _all_rows(tiny_copy, "clamp")
    if column == "label" and np.isnan(value):  # cannot be clamped: skipped
        np.testing.assert_array_equal(got_labels, labels[keep])
        return
    expected_labels, expected_dense = labels.copy(), dense.copy()
    if column == "label":
        expected_labels[global_row] = np.clip(value, 0, 1)
    else:
        clamped = np.clip(value, -FLOAT32_MAX, FLOAT32_MAX)
        expected_dense[global_row, CRITEO.dense.index(column)] = np.log1p(max(clamped, 0))
    np.testing.assert_array_equal(got_labels, expected_labels)
    np.testing.assert_allclose(got_dense, expected_dense, rtol=1e-6)
    assert np.isfinite(got_dense).all()


def test_nan_and_null_dense_values_are_missing_not_bad(tiny_copy):
    _damage(tiny_copy, "I3", np.nan)
    labels, dense = _all_rows(tiny_copy, "error")
    assert dense[256 + ROW, CRITEO.dense.index("I3")] == 0.0
    np.testing.assert_array_equal(labels, _reference(tiny_copy)[0])


def test_skipped_rows_are_counted_once_over_epochs_and_listed(tiny_copy):
    for part, row in (("part-00000.parquet", 3), ("part-00001.parquet", 0), ("part-00002.parquet", 200)):
        _damage(tiny_copy, "label", 2.0, part, row)
    for row in range(6):
        _damage(tiny_copy, "I1", np.inf, "part-00001.parquet", 100 + row)
    reader = ParquetBatchReader(tiny_copy, 64, SIZES, bad_values="skip")
    for _ in range(2):  # two epochs: the same rows again
        assert sum(b.labels.numel() for b in reader) == 1024 - 9
    counts = reader.bad_value_log.counts()
    assert (counts.skipped, counts.clamped) == (9, 0)
    lines = counts.lines()
    assert lines[0] == "bad values: skipped 9 rows"
    part = tiny_copy / "part-00000.parquet"
    assert lines[1] == f"  skipped {part}: row 3, column label: 2.0 is not a label in [0, 1]"
    assert lines[-1] == f"  ... and {9 - (len(lines) - 2)} more"


def test_resume_position_counts_kept_rows(tiny_copy):
    """A position in rows after skipped rows resumes exactly where the full pass was."""
    for row in (5, 40, 41, 130):
        _damage(tiny_copy, "label", np.nan, "part-00000.parquet", row)
    reader = ParquetBatchReader(tiny_copy, 32, SIZES, bad_values="skip")
    full = np.concatenate([b.labels.numpy() for b in reader])
    dense = np.concatenate([b.dense_features.numpy() for b in reader])
    for start in (32, 96, 160):
        tail = list(reader.iter_from_row(start))
        np.testing.assert_array_equal(np.concatenate([b.dense_features.numpy() for b in tail]), dense[start:])
        np.testing.assert_array_equal(np.concatenate([b.labels.numpy() for b in tail]), full[start:])


def test_lockstep_reader_yields_only_full_batches_after_skips(tiny_copy):
    _damage(tiny_copy, "label", 5.0, "part-00000.parquet", 7)
    for rank in (0, 1):
        reader = ParquetBatchReader(tiny_copy, 64, SIZES, rank=rank, world_size=2, drop_last=True, bad_values="skip")
        sizes = [b.labels.numel() for b in reader]
        assert set(sizes) == {64}
        assert len(sizes) == (7 if rank == 0 else 8)  # rank 0 lost one row: its last batch is short, dropped


def test_train_config_offers_the_reader_policies():
    assert BAD_VALUE_POLICIES == POLICIES


# --- the CLI: train and infer ---------------------------------------------------------------

def test_train_default_is_one_error_line_and_skip_reports_counts(capsys, tiny_copy, tmp_path):
    path = _damage(tiny_copy, "I5", np.inf, part="part-00000.parquet")  # within the 2 steps
    args = ["train", "--data", str(tiny_copy), *TRAIN_FLAGS, "--engine", "torchrec"]
    rc = main([*args, "--log-dir", str(tmp_path / "error")])
    assert_clean_error(rc, capsys.readouterr().err, f"{path}: row {ROW}, column I5: inf is beyond float32's range")
    rc = main([*args, "--log-dir", str(tmp_path / "skip"), "--bad-values", "skip"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "bad values: skipped 1 row\n" in out and f"skipped {path}: row {ROW}, column I5: inf" in out


def _predict(predictor: Predictor, output: Path, policy: str) -> tuple[dict, pa.Table | None]:
    """Run the inference actor's code in this process (one model load for every policy)."""
    config = dataclasses.replace(predictor.config, output=str(output), bad_values=policy)
    predictor.config = config
    units = plan_units(config.data, config.input_columns)
    claim_output_dir(output, units, Path(config.checkpoint))
    columns = {f.name: np.array([getattr(u, f.name) for u in units]) for f in dataclasses.fields(Unit)}
    result = predictor.predict_units(columns)
    parts = sorted(output.glob("part-*.parquet"))
    return result, pa.concat_tables([pq.read_table(p) for p in parts]) if parts else None


def test_infer_policies(tmp_path_factory, tmp_path):
    """Inference applies the same policy: the default error (in the result, for the driver to
    raise), skip leaves the row out of the output, clamp predicts from the clamped value."""
    data, root = shared_run(tmp_path_factory)
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    (copy / "_COMPLETE.json").unlink()
    path = _damage(copy, "I2", np.inf, part="part-00000.parquet")
    predictor = Predictor(InferenceConfig(data=str(copy), checkpoint=str(root), output=""), threads=1, with_label=False)
    result, written = _predict(predictor, tmp_path / "error", "error")
    error = result["error"][0]
    assert isinstance(error, BadValueError) and f"{path}: row {ROW}, column I2: inf" in str(error)
    assert written is None

    result, written = _predict(predictor, tmp_path / "skip", "skip")
    assert result["skipped"].sum() == 1 and all(e is None for e in result["error"])
    assert ROW not in written.column("row_id").to_pylist() and written.num_rows == 3 * 512 - 1
    assert np.isfinite(written.column("prediction").to_numpy()).all()

    _damage(copy, "I2", FLOAT32_MAX, part="part-00000.parquet")  # what clamp makes of +inf
    _, reference = _predict(predictor, tmp_path / "reference", "error")
    _damage(copy, "I2", np.inf, part="part-00000.parquet")
    result, clamped = _predict(predictor, tmp_path / "clamp", "clamp")
    assert result["clamped"].sum() == 1
    assert clamped.equals(reference)


def _null_id_in_a_list(data: Path) -> Path:
    """C3 as multi-hot lists in every file, ``[id, null]`` at row ROW of PART."""
    for path in sorted(data.glob("*.parquet")):
        table = pq.read_table(path)
        ids = [[v] if v is not None else [] for v in table.column("C3").to_pylist()]
        if path.name == PART:
            ids[ROW] = [ids[ROW][0] if ids[ROW] else 1, None]
        pq.write_table(table.set_column(table.schema.get_field_index("C3"), "C3",
                                        pa.array(ids, pa.list_(pa.int64()))), path)
    return data / PART


def test_null_id_inside_a_multi_hot_list_names_file_row_and_column(capsys, tiny_copy, tmp_path):
    part = _null_id_in_a_list(tiny_copy)
    flags = [f for f in TRAIN_FLAGS if f not in ("--max-steps", "2")]  # an epoch: the bad row is read
    rc = main(["train", "--data", str(tiny_copy), *flags, "--log-dir", str(tmp_path / "run")])
    assert_clean_error(rc, capsys.readouterr().err, f"{part}: row {ROW}, column C3: a null id inside a multi-hot list")
    for policy in ("skip", "clamp"):  # the row cannot be repaired: both drop it
        labels, _ = _all_rows(tiny_copy, policy)
        assert len(labels) == 1024 - 1  # every file, the held-out one included
