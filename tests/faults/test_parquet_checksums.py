"""Parquet page checksums: every file the project writes (`data generate`, `data convert`, `infer`'s
predictions) carries them and every read verifies them. 64 flipped bytes inside a page are an error
naming the file and row group, never different ids; files without checksums (other tools') still
read. The damage goes into a dictionary page, where it decodes silently to other ids without
checksums (a damaged data page mostly fails decompression anyway)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.convert import convert_to_parquet
from pipelines.parquet_files import ParquetDataError, read_columns, read_row_group
from pipelines.parquet_reader import ParquetBatchReader
from tests.faults.checkpoint_helpers import shared_run
from tests.faults.conftest import TRAIN_FLAGS
from tests.faults.helpers import assert_clean_error, run_cli, write_sample_tsv
from torchrec_tpu.cli import main
from torchrec_tpu.inference.units import Unit, write_part

SIZES = (100,) * 26
FLIPPED = 64


def flip_page_bytes(path: Path, column: str) -> None:
    """XOR 64 bytes in the middle of ``column``'s first page in row group 0 (its dictionary page
    when it has one), located from the footer."""
    chunk = pq.ParquetFile(path).metadata.row_group(0)
    meta = next(chunk.column(i) for i in range(chunk.num_columns) if chunk.column(i).path_in_schema == column)
    if meta.has_dictionary_page:
        start, end = meta.dictionary_page_offset, meta.data_page_offset
    else:
        start, end = meta.data_page_offset, meta.data_page_offset + meta.total_compressed_size
    assert end - start >= 3 * FLIPPED, f"{column}'s page is too small to damage past its header"
    data = bytearray(path.read_bytes())
    middle = (start + end) // 2
    for offset in range(middle - FLIPPED // 2, middle + FLIPPED // 2):
        data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def _generated(tmp_path: Path, capsys) -> Path:
    out = tmp_path / "data"
    rc = main(["data", "generate", "-o", str(out), "--rows", "2048", "--rows-per-file", "512",
               "--row-group-size", "256", "--seed", "5", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    return out


def _assert_checksum_error(error: str, path: Path, row_group: int = 0) -> None:
    assert f"{path}: row group {row_group} is not readable" in error and "checksum" in error, error


def test_damaged_page_of_a_generated_file_fails_reader_and_train(tmp_path, capsys):
    data = _generated(tmp_path, capsys)
    part = data / "part-00000.parquet"
    flip_page_bytes(part, "C1")
    with pytest.raises(ParquetDataError) as raised:
        list(ParquetBatchReader(data, 64, SIZES))
    _assert_checksum_error(str(raised.value), part)
    rc = main(["train", "--data", str(data), *TRAIN_FLAGS, "--log-dir", str(tmp_path / "run")])
    line = assert_clean_error(rc, capsys.readouterr().err, str(part), "row group 0")
    assert "checksum" in line, line


def test_damaged_page_of_a_converted_file_is_an_error(tmp_path):
    out = tmp_path / "out"
    convert_to_parquet([write_sample_tsv(tmp_path / "day.tsv")], out, progress=False)
    part = out / "part-00000.parquet"
    flip_page_bytes(part, "C3")
    with pytest.raises(ParquetDataError) as raised:
        read_row_group(part, 0, ["C3"])
    _assert_checksum_error(str(raised.value), part)


def test_damaged_page_of_written_predictions_is_an_error(tmp_path):
    rng = np.random.default_rng(0)
    table = pa.table({"row_id": np.arange(4096), "prediction": rng.random(4096, dtype=np.float32)})
    part = write_part(tmp_path, Unit(ordinal=0, path="in.parquet", row_group=0, first_row=0, num_rows=4096), table)
    assert read_row_group(part, 0, ["row_id", "prediction"]).equals(table)
    flip_page_bytes(part, "prediction")
    with pytest.raises(ParquetDataError) as raised:
        read_row_group(part, 0, ["prediction"])
    _assert_checksum_error(str(raised.value), part)
    with pytest.raises(ParquetDataError, match="checksum") as raised:  # as infer's offline AUC reads them
        read_columns(part, ["prediction"])
    assert str(raised.value).startswith(f"{part}: ")


def test_files_without_checksums_still_read(tmp_path, capsys):
    data = _generated(tmp_path, capsys)
    plain = tmp_path / "plain"
    plain.mkdir()
    for part in sorted(data.glob("*.parquet")):
        pq.write_table(pq.read_table(part), plain / part.name, row_group_size=256)  # no checksums
    expected = list(ParquetBatchReader(data, 64, SIZES))
    got = list(ParquetBatchReader(plain, 64, SIZES))
    assert len(got) == len(expected) == 32
    for a, b in zip(got, expected):
        assert a.sparse_features.values().equal(b.sparse_features.values())
        assert a.dense_features.equal(b.dense_features) and a.labels.equal(b.labels)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_infer_refuses_a_damaged_page(tmp_path_factory, tmp_path, capsys):
    _, root = shared_run(tmp_path_factory)  # a checkpoint of tables of 100 rows: ids are hashed into them
    data = _generated(tmp_path, capsys)
    part = data / "part-00001.parquet"
    flip_page_bytes(part, "C1")
    result = run_cli("infer", "--data", str(data), "--checkpoint", str(root), "--output", str(tmp_path / "out"),
                     "--no-progress")
    line = assert_clean_error(result.returncode, result.stderr, str(part), "row group 0")
    assert "checksum" in line, line
