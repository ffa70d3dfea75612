import pyarrow.parquet as pq
import pytest

from pipelines.convert import convert_to_parquet
from pipelines.schema import CRITEO
from pipelines.text_reader import BadRowError
from tests.pipelines.reference import reference_rows, sample_fields, write_tsv


def test_round_trip_every_value_equal(sample_csv, tmp_path):
    report = convert_to_parquet(
        [sample_csv], tmp_path / "out", rows_per_file=64, row_group_size=16, progress=False
    )
    assert report.rows_read == report.rows_written == 200 and report.rows_skipped == 0
    assert [p.name for p in report.files] == [f"part-0000{i}.parquet" for i in range(4)]
    metadata = [pq.ParquetFile(p).metadata for p in report.files]
    assert [m.num_rows for m in metadata] == [64, 64, 64, 8]
    assert [m.row_group(0).num_rows for m in metadata] == [16, 16, 16, 8]
    table = pq.read_table(tmp_path / "out")
    assert table.schema == CRITEO.arrow_schema()
    assert table.to_pylist() == reference_rows(sample_csv)


def test_several_inputs_with_skipped_rows_are_accounted(sample_csv, tmp_path):
    fields = sample_fields(sample_csv)
    clean = write_tsv(fields[:120], tmp_path / "day_0")
    dirty_fields = fields[120:]
    dirty_fields[4] = dirty_fields[4][:-2]
    dirty_fields[9][3] = "NaN"
    dirty = write_tsv(dirty_fields, tmp_path / "day_1")
    with pytest.raises(BadRowError, match=r"day_1:5: expected 40 columns, got 38"):
        # Files of day_0 are complete before day_1 fails; the failed run removes them too.
        convert_to_parquet([clean, dirty], tmp_path / "strict", rows_per_file=50, progress=False)
    assert not (tmp_path / "strict").exists(), "a failed run must leave no dataset"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".strict")], "nor a staging dir"
    report = convert_to_parquet([clean, dirty], tmp_path / "out", on_bad_row="skip", progress=False)
    assert (report.rows_read, report.rows_written, report.rows_skipped) == (200, 198, 2)
    assert [(b.path, b.line) for b in report.bad_rows] == [(str(dirty), 5), (str(dirty), 10)]
    assert "I3" in report.bad_rows[1].reason
    expected = [row for i, row in enumerate(reference_rows(sample_csv)) if i not in (124, 129)]
    assert pq.read_table(tmp_path / "out").to_pylist() == expected
    assert "skipped 2 malformed rows" in report.summary()


def test_refuses_non_empty_output_and_missing_input(sample_csv, tmp_path):
    convert_to_parquet([sample_csv], tmp_path / "out", progress=False)
    with pytest.raises(FileExistsError, match="is not empty"):
        convert_to_parquet([sample_csv], tmp_path / "out", progress=False)
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        convert_to_parquet([tmp_path / "nope.tsv"], tmp_path / "other", progress=False)
