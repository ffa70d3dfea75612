"""Parquet files -> ``torchrec.datasets.utils.Batch`` stream, sharded over ranks.

Sharding: the files (in the order given; a directory's ``*.parquet`` files sorted by name) form
one global row sequence of N rows. Rank r of W reads the contiguous rows
``[r * N // W, (r + 1) * N // W)``, so every row belongs to exactly one rank and the ranks' row
counts differ by at most one. Only the row groups overlapping a rank's range are read.

Last partial batch: with ``drop_last=False`` each rank yields its rows in full, the last batch
possibly smaller than ``batch_size`` (ranks can then differ by one batch). With ``drop_last=True``
every rank yields the same number of full batches, ``(N // W) // batch_size``, and the remainder of
each range is dropped (``rows_dropped``), which lock-step distributed training needs.

Bad label and dense values follow ``bad_values`` (:mod:`pipelines.bad_values`), applied to each
row group's rows before batching, so skipped rows never leave a batch short (with ``drop_last``
a short last batch is dropped). Positions (``iter_from_row``) count the rows kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from pipelines.arrow_batch import TableSizes, batch_from_arrow, table_sizes_for
from pipelines.bad_value_policies import POLICIES
from pipelines.bad_values import BadValueLog, Source, apply_policy, kept_rows
from pipelines.parquet_checksums import note_unverifiable
from pipelines.parquet_files import (  # noqa: F401  (re-exported: the readers' file helpers)
    ParquetDataError,
    check_column_types,
    list_parquet_files,
    open_parquet,
    read_row_group,
)
from pipelines.schema import CRITEO, DatasetSchema
from pipelines.streams import BatchStream, prefetched


@dataclass(frozen=True)
class RowGroup:
    path: Path
    index: int
    first_row: int  # global row index of the group's first row
    num_rows: int
    file_row: int = 0  # row index of the group's first row within its file


def shard_range(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``rank``: contiguous, balanced, covering all rows once."""
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank * num_rows // world_size, (rank + 1) * num_rows // world_size


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values, else those of the initialized default process group, else (0, 1)."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        return (
            dist.get_rank() if rank is None else rank,
            dist.get_world_size() if world_size is None else world_size,
        )
    return rank or 0, world_size or 1


class ParquetBatchReader(BatchStream):
    """Iterable of Batches of ``batch_size`` rows from Parquet files (see the module docstring).

    ``rank`` / ``world_size`` default to those of the initialized ``torch.distributed`` default
    group (else a single rank). ``prefetch_row_groups`` row groups are decoded ahead on a
    background thread (0: none). ``rows``: read only rows ``[lo, hi)`` of the files' global row
    sequence, sharded over the ranks as all rows are otherwise (None: every row).
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        batch_size: int,
        num_embeddings_per_feature: TableSizes,
        schema: DatasetSchema = CRITEO,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        prefetch_row_groups: int = 2,
        bad_values: str = "error",
        rows: tuple[int, int] | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if bad_values not in POLICIES:
            raise ValueError(f"bad_values must be one of {list(POLICIES)}, got {bad_values!r}")
        self.bad_values = bad_values
        self.bad_value_log = BadValueLog()  # rows skipped / clamped so far
        self.drop_last = drop_last
        self.files = list_parquet_files(paths)
        self.batch_size = batch_size
        self.table_sizes = table_sizes_for(schema, num_embeddings_per_feature)
        self.schema = schema
        self.prefetch_row_groups = prefetch_row_groups
        self.row_groups = self._index_row_groups()
        total = sum(group.num_rows for group in self.row_groups)
        first, end = rows if rows is not None else (0, total)
        if not 0 <= first <= end <= total:
            raise ValueError(f"rows {rows} are not within the {total} rows of {[str(f) for f in self.files]}")
        self.num_rows = end - first
        self.rows = rows
        rank, world_size = _resolve_rank(rank, world_size)
        if rank == 0:  # one rank says which files cannot be verified
            note_unverifiable(self.files)
        start, stop = shard_range(self.num_rows, rank, world_size)
        if drop_last:
            stop = start + (self.num_rows // world_size) // batch_size * batch_size
        self.rows_dropped = shard_range(self.num_rows, rank, world_size)[1] - stop
        self.start, self.stop = first + start, first + stop

    def _index_row_groups(self) -> list[RowGroup]:
        groups: list[RowGroup] = []
        first_row = 0
        for path in self.files:
            parquet_file = open_parquet(path)
            metadata = parquet_file.metadata
            names = parquet_file.schema_arrow.names
            missing = [n for n in self.schema.column_names if n not in names]
            if missing:
                raise ParquetDataError(f"{path}: columns {missing} of the schema are missing")
            check_column_types(path, parquet_file.schema_arrow, self.schema)
            file_row = 0
            for index in range(metadata.num_row_groups):
                rows = metadata.row_group(index).num_rows
                groups.append(RowGroup(path, index, first_row, rows, file_row))
                first_row += rows
                file_row += rows
        return groups

    def __len__(self) -> int:
        return -(-(self.stop - self.start) // self.batch_size)

    def _slices(self, start: int, columns: Sequence[str]) -> Iterator[tuple[int, pa.Table, Source]]:
        """The rows of this rank's range from global row ``start`` on, one table per overlapping
        row group: (global row of its first row, table, where that row sits in its file)."""
        open_path, parquet_file = None, None
        for group in self.row_groups:
            lo = max(start, group.first_row)
            hi = min(self.stop, group.first_row + group.num_rows)
            if lo >= hi:
                continue
            if group.path != open_path:
                open_path, parquet_file = group.path, open_parquet(group.path)
            table = read_row_group(group.path, group.index, columns, parquet_file)
            offset = lo - group.first_row
            yield lo, table.slice(offset, hi - lo), Source(str(group.path), group.file_row + offset)

    def _tables(self, start: int) -> Iterator[pa.Table]:
        """:meth:`_slices` with the bad-value policy applied."""
        for _, table, source in self._slices(start, self.schema.column_names):
            yield apply_policy(table, self.schema, self.bad_values, source, self.bad_value_log)

    def _raw_start(self, kept: int) -> int:
        """The global row after the first ``kept`` rows of this rank's range that pass the
        policy (to count them, only the label and dense columns are read)."""
        if self.bad_values == "error" or kept == 0:
            return self.start + kept
        counted = 0
        for first, table, _ in self._slices(self.start, [self.schema.label, *self.schema.dense]):
            mask = kept_rows(table, self.schema, self.bad_values)
            here = int(mask.sum())
            if counted + here >= kept:
                return first + int(np.flatnonzero(mask)[kept - counted - 1]) + 1
            counted += here
        return self.stop

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from(0)

    def iter_from(self, batch: int) -> Iterator[Batch]:
        """The batches from index ``batch`` on, exactly as iterating would yield them after the
        first ``batch``; only the row groups from that batch's first row on are read."""
        if batch < 0:
            raise ValueError(f"batch index must be >= 0, got {batch}")
        return self.iter_from_row(batch * self.batch_size)

    def iter_from_row(self, row: int) -> Iterator[Batch]:
        """Batches of ``batch_size`` rows starting at row ``row`` of this rank's range (the
        batches iterating yields when ``row`` is a multiple of ``batch_size``)."""
        if row < 0:
            raise ValueError(f"row must be >= 0, got {row}")
        return self._iter_rows(min(self._raw_start(row), self.stop))

    def _iter_rows(self, start: int) -> Iterator[Batch]:
        pending: list[pa.Table] = []
        pending_rows = 0
        for table in prefetched(self._tables(start), self.prefetch_row_groups):
            pending.append(table)
            pending_rows += table.num_rows
            if pending_rows < self.batch_size:
                continue
            rows = _concat(pending)
            full = pending_rows // self.batch_size * self.batch_size
            for offset in range(0, full, self.batch_size):
                yield self._batch(rows.slice(offset, self.batch_size))
            pending, pending_rows = [rows.slice(full)], pending_rows - full
        if pending_rows and not self.drop_last:  # with drop_last: short only after skipped rows
            yield self._batch(_concat(pending))

    def _batch(self, rows: pa.Table) -> Batch:
        return batch_from_arrow(rows, self.table_sizes, self.schema)


def _concat(tables: list[pa.Table]) -> pa.Table:
    """One table; files may store a column in different numeric types (int8 and float labels)."""
    return pa.concat_tables(tables, promote_options="permissive")
