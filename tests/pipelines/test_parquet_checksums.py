"""Parquet inputs without page checksums are detected and a job says so once: the page-header
reader against hand-encoded Thrift headers and files pyarrow writes with and without checksums;
one warning line from train's data, infer's planning and the readers."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.parquet_checksums import LISTED, has_page_checksums, header_has_crc, note_unverifiable
from pipelines.parquet_reader import ParquetBatchReader
from pipelines.parquet_writer import write_table
from pipelines.synthetic import SyntheticConfig, generate

TABLE = pa.table({"id": list(range(1000)), "tags": [[1, 2]] * 1000, "name": ["x"] * 1000})
SMALL = SyntheticConfig(num_rows=5 * 64, seed=1, max_cardinality=50, rows_per_file=64, row_group_size=32)
WARNING = "carry no page checksums"


def _zigzag_varint(value: int) -> bytes:
    raw, out = (value << 1) ^ (value >> 63), b""
    while True:
        byte, raw = raw & 0x7F, raw >> 7
        out += bytes([byte | (0x80 if raw else 0)])
        if not raw:
            return out


def _header(fields: list[tuple[int, int]]) -> bytes:
    """A compact-protocol PageHeader of i32 ``(field id, value)`` pairs (short-form field headers,
    type 5), then a DataPageHeader struct (field 5, type 12) left open."""
    out, last = b"", 0
    for field, value in fields:
        out += bytes([(field - last) << 4 | 5]) + _zigzag_varint(value)
        last = field
    return out + bytes([(5 - last) << 4 | 12]) + b"\x15\x80\x01"


def test_the_header_reader_finds_the_crc_field() -> None:
    sizes = [(1, 0), (2, 4000), (3, 1200)]
    assert header_has_crc(_header([*sizes, (4, -123456789)]))
    assert not header_has_crc(_header(sizes))
    assert not header_has_crc(b"")
    assert not header_has_crc(b"\x15\x80")  # truncated varint
    long_form = b"\x05\x08" + _zigzag_varint(7)  # field id 4 spelled out (zigzag 4 = 8), i32 type
    assert header_has_crc(b"\x15\x00\x15\x02\x15\x02" + long_form)


@pytest.mark.parametrize("options", [{}, {"use_dictionary": False}, {"data_page_version": "2.0"},
                                     {"compression": "none"}])
def test_files_with_and_without_checksums(tmp_path: Path, options: dict) -> None:
    pq.write_table(TABLE, tmp_path / "with.parquet", row_group_size=300, write_page_checksum=True, **options)
    pq.write_table(TABLE, tmp_path / "without.parquet", row_group_size=300, **options)
    assert has_page_checksums(tmp_path / "with.parquet")
    assert not has_page_checksums(tmp_path / "without.parquet")


def test_the_projects_writers_write_checksums(tmp_path: Path) -> None:
    write_table(TABLE, tmp_path / "one.parquet")
    generate(SMALL, tmp_path / "generated", progress=False)
    assert has_page_checksums(tmp_path / "one.parquet")
    assert all(has_page_checksums(p) for p in (tmp_path / "generated").glob("*.parquet"))
    pq.write_table(TABLE.slice(0, 0), tmp_path / "empty.parquet")
    assert has_page_checksums(tmp_path / "empty.parquet")  # no page to verify


def _strip_checksums(directory: Path, count: int) -> list[Path]:
    """Rewrite the first ``count`` files of ``directory`` without checksums, as other tools write."""
    files = sorted(directory.glob("*.parquet"))[:count]
    for path in files:
        pq.write_table(pq.read_table(path), path, row_group_size=SMALL.row_group_size)
    return files


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]


def test_readers_say_once_which_files_cannot_be_verified(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    generate(SMALL, data, progress=False)
    stripped = _strip_checksums(data, LISTED + 1)
    caplog.set_level(logging.WARNING)
    ParquetBatchReader(data, 32, SMALL.table_sizes)
    ParquetBatchReader(data, 16, SMALL.table_sizes)  # the same files again: nothing new to say
    ParquetBatchReader(data, 16, SMALL.table_sizes, rank=1, world_size=2)
    (line,) = _warnings(caplog)
    assert line.startswith(f"{LISTED + 1} of 5 input Parquet file(s) carry no page checksums")
    assert all(str(p) in line for p in stripped[:LISTED]) and str(stripped[LISTED]) not in line
    assert " and 1 more" in line
    assert note_unverifiable(sorted(data.glob("*.parquet"))) == []  # noted already
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1" + bytes(300) + b"PAR1")
    assert note_unverifiable([tmp_path / "corrupt.parquet"]) == []  # its reader names the damage


def test_train_and_infer_say_it_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from torchrec_tpu.inference.units import plan_units
    from torchrec_tpu.train.config import TrainConfig
    from torchrec_tpu.train.data import open_data
    from torchrec_tpu.train.distributed import DistEnv

    caplog.set_level(logging.WARNING)
    train = tmp_path / "train"
    generate(SMALL, train, progress=False)
    (stripped,) = _strip_checksums(train, 1)
    config = TrainConfig.from_options(data=str(train), num_embeddings=50, batch_size=32, eval_batch_size=32,
                                      eval_files=2, log_dir=str(tmp_path / "logs"))
    with open_data(config, DistEnv(rank=0, world_size=1, local_world_size=1)):
        pass
    (line,) = _warnings(caplog)
    assert line.startswith("1 of 5 input Parquet file(s)") and str(stripped) in line

    caplog.clear()
    infer = tmp_path / "infer"
    generate(SMALL, infer, progress=False)
    _strip_checksums(infer, 2)
    plan_units(infer, [])
    assert len(_warnings(caplog)) == 1 and _warnings(caplog)[0].startswith("2 of 5 input")
