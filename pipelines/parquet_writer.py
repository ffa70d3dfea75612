"""Chunked Parquet output: a stream of record batches becomes ``part-NNNNN.parquet`` files of at
most ``rows_per_file`` rows, each with row groups of ``row_group_size`` rows (the last may be
smaller). Each file is written under a temporary name and renamed when complete, so a killed run
leaves no partial ``.parquet`` file behind; a run that fails with an exception removes its files
(``.tmp`` part included, also when closing it fails again, as on a full disk). Whole datasets are
published atomically by :mod:`pipelines.dataset_dir`.

Every Parquet file the project writes carries page checksums (CRC32 of each page) and its readers
(:func:`pipelines.parquet_reader.open_parquet`) verify them: a damaged page is an error, never
different ids. Files written elsewhere without checksums still read, and a job names them once
(:mod:`pipelines.parquet_checksums`).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

import pyarrow as pa
import pyarrow.parquet as pq

PARQUET_SUFFIX = ".parquet"


def write_table(table: pa.Table, path: str | Path) -> None:
    """``pq.write_table`` with page checksums (for single-file outputs such as predictions)."""
    pq.write_table(table, path, write_page_checksum=True)


def written_rows(files: list[Path]) -> int:
    """Row count of Parquet files according to their footers."""
    return sum(pq.ParquetFile(path).metadata.num_rows for path in files)


class ParquetShardWriter:
    """Writes record batches of one schema into numbered Parquet files under ``output_dir``."""

    def __init__(
        self,
        output_dir: str | Path,
        schema: pa.Schema,
        rows_per_file: int = 1 << 20,
        row_group_size: int = 1 << 16,
        compression: str = "zstd",
    ) -> None:
        if rows_per_file <= 0 or row_group_size <= 0:
            raise ValueError(
                f"rows_per_file ({rows_per_file}) and row_group_size ({row_group_size}) must be > 0"
            )
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        existing = sorted(self.output_dir.glob(f"*{PARQUET_SUFFIX}"))
        if existing:
            raise FileExistsError(
                f"{self.output_dir} already holds Parquet files ({existing[0].name}, ...); "
                "write into an empty directory"
            )
        self.schema = schema
        self.rows_per_file = rows_per_file
        self.row_group_size = min(row_group_size, rows_per_file)
        self.compression = compression
        self.files: list[Path] = []
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._temp_path: Path | None = None
        self._rows_in_file = 0

    def write(self, batch: pa.RecordBatch) -> None:
        """Buffers ``batch`` and writes every complete row group."""
        if batch.schema != self.schema:
            raise ValueError(f"batch schema {batch.schema} differs from the writer's {self.schema}")
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        while self._pending_rows >= self._next_group_rows():
            self._write_group(self._next_group_rows())

    def close(self) -> list[Path]:
        """Writes what is buffered, finishes the last file and returns all files written."""
        while self._pending_rows:
            self._write_group(min(self._pending_rows, self._next_group_rows()))
        self._finish_file()
        return self.files

    def _next_group_rows(self) -> int:
        return min(self.row_group_size, self.rows_per_file - self._rows_in_file)

    def _write_group(self, rows: int) -> None:
        table = pa.Table.from_batches(self._pending, schema=self.schema)
        group, rest = table.slice(0, rows), table.slice(rows)
        self._pending = rest.to_batches() if rest.num_rows else []
        self._pending_rows = rest.num_rows
        if self._writer is None:
            self._open_file()
        assert self._writer is not None
        self._writer.write_table(group, row_group_size=rows)
        self._rows_in_file += rows
        if self._rows_in_file == self.rows_per_file:
            self._finish_file()

    def _open_file(self) -> None:
        name = f"part-{len(self.files):05d}{PARQUET_SUFFIX}"
        self._temp_path = self.output_dir / f".{name}.tmp"
        self._writer = pq.ParquetWriter(self._temp_path, self.schema, compression=self.compression,
                                       write_page_checksum=True)
        self.files.append(self.output_dir / name)

    def _finish_file(self) -> None:
        if self._writer is None or self._temp_path is None:
            return
        self._writer.close()
        os.replace(self._temp_path, self.files[-1])
        self._writer, self._temp_path, self._rows_in_file = None, None, 0

    def __enter__(self) -> ParquetShardWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                self._discard()
                raise
            return
        self._discard()

    def _discard(self) -> None:
        """Remove everything written, finished files included: a partial dataset must not pass
        for a complete one."""
        if self._writer is not None and self._temp_path is not None:
            try:
                self._writer.close()  # may fail again (a full disk): the file goes regardless
            except OSError:
                pass
            finally:
                self._temp_path.unlink(missing_ok=True)
                self.files.pop()
                self._writer, self._temp_path = None, None
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files = []
