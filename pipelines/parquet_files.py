"""Parquet files as the readers find them, with pyarrow only (no torch): a directory's files, a
file opened or a row group read with errors naming the file, column types checked. Light enough
for a job's checks before it imports torch (``torchrec-tpu infer`` with nothing left to do)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.dataset_dir import check_dataset_dir
from pipelines.parquet_writer import PARQUET_SUFFIX
from pipelines.schema import DatasetSchema


def list_parquet_files(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """A directory's ``*.parquet`` files sorted by name, or the given files in order. A directory
    marked incomplete, or whose files disagree with its completion marker, is refused
    (:func:`pipelines.dataset_dir.check_dataset_dir`)."""
    entries = [paths] if isinstance(paths, (str, Path)) else list(paths)
    files: list[Path] = []
    for entry in map(Path, entries):
        if entry.is_dir():
            parts = sorted(entry.glob(f"*{PARQUET_SUFFIX}"))
            check_dataset_dir(entry, parts)
            files += parts
        elif entry.is_file():
            files.append(entry)
        else:
            raise FileNotFoundError(f"no such Parquet file or directory: {entry}")
    if not files:
        raise FileNotFoundError(f"no {PARQUET_SUFFIX} files in {[str(e) for e in entries]}")
    return files


class ParquetDataError(ValueError):
    """A Parquet input cannot be read (corrupt, truncated, not Parquet) or has columns of the
    wrong type; the message names the file (and column)."""


_FOOTER_TAIL = 8  # a little-endian footer length, then b"PAR1"


def footer_sha256(file: BinaryIO) -> str:
    """SHA-256 of an open Parquet file's footer (every row group's offsets, sizes and statistics):
    the file's content identity, wherever it is and whatever its name or mtime."""
    file.seek(0, 2)
    size = file.tell()
    tail_start = max(0, size - _FOOTER_TAIL)
    file.seek(tail_start)
    footer_length = int.from_bytes(file.read(_FOOTER_TAIL)[:4], "little")
    file.seek(max(0, tail_start - footer_length))
    return hashlib.sha256(file.read()).hexdigest()


def open_parquet(path: Path) -> pq.ParquetFile:
    """``pq.ParquetFile(path)`` verifying the pages' checksums where the file has them (a damaged
    page then fails :func:`read_row_group`); a file that is not readable Parquet raises
    ParquetDataError."""
    try:
        return pq.ParquetFile(path, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as error:
        raise ParquetDataError(f"{path}: not a readable Parquet file ({error})") from None


def read_row_group(path: Path, index: int, columns: Sequence[str],
                   parquet_file: pq.ParquetFile | None = None) -> pa.Table:
    """Row group ``index`` of ``path``; corrupt data pages raise ParquetDataError naming the file."""
    try:
        return (parquet_file or open_parquet(path)).read_row_group(index, columns=list(columns))
    except (pa.ArrowException, OSError) as error:
        raise ParquetDataError(f"{path}: row group {index} is not readable ({error})") from None


def read_columns(path: Path, columns: Sequence[str]) -> pa.Table:
    """``columns`` of every row of ``path``; damaged pages raise ParquetDataError naming the file."""
    try:
        return open_parquet(path).read(columns=list(columns))
    except (pa.ArrowException, OSError) as error:
        raise ParquetDataError(f"{path}: not readable ({error})") from None


def check_column_types(path: Path, arrow_schema: pa.Schema, schema: DatasetSchema,
                       label: bool = True) -> None:
    """ParquetDataError naming ``path`` and the column when one of ``schema``'s columns has a
    type the readers cannot use (label and dense: numeric; categorical: integer ids or lists of
    them); missing columns are the caller's to report."""
    def numeric(t: pa.DataType) -> bool:
        return pa.types.is_integer(t) or pa.types.is_floating(t)

    def ids(t: pa.DataType) -> bool:
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return pa.types.is_integer(t.value_type)
        return pa.types.is_integer(t)

    wanted = [(name, numeric, "numeric") for name in schema.dense]
    if label:
        wanted.insert(0, (schema.label, numeric, "numeric"))
    wanted += [(name, ids, "integer ids or list<integer>") for name in schema.sparse]
    names = arrow_schema.names
    for name, ok, expected in wanted:
        if name in names and not ok(arrow_schema.field(name).type):
            raise ParquetDataError(
                f"{path}: column {name} must be {expected}, got {arrow_schema.field(name).type}"
            )
