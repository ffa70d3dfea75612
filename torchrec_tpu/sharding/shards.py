"""Where each table's rows and columns live: per-table sharding choices and the shards they make.

Sharding types (``tpu_facts.ShardingKind``, TorchRec's names; the planner's too):

- ``table_wise``: the whole table on one rank.
- ``row_wise``: rows mod-sharded over all ranks, as SparseCore mod-shards over its cores: id ``i``
  lives on rank ``i mod W`` as local row ``i div W``.
- ``column_wise``: column blocks on several ranks (each block is a table-wise table of its own,
  with its own optimizer state: a row-wise slot, e.g. row-wise Adagrad's, is per block, as in
  TorchRec, so the full row slot of a table in c blocks has ``c * vocab`` entries, block-major).
- ``data_parallel``: a full replica on every rank; every replica applies the same fused update
  on the global batch, so the replicas stay equal without an all-reduce of the tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from sparsecore.specs import TableSpec
from tpu_facts import ShardingKind

SHARDING_TYPES = tuple(kind.value for kind in ShardingKind)


@dataclass(frozen=True)
class TableSharding:
    """How one table is sharded. ``ranks``: the owner (table_wise, one rank) or the ranks of the
    column blocks in column order (column_wise); unused for row_wise / data_parallel."""

    kind: str
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in SHARDING_TYPES:
            raise ValueError(f"sharding type must be one of {SHARDING_TYPES}, got {self.kind!r}")


@dataclass(frozen=True)
class Shard:
    """Rows ``row_offset + k * row_stride`` (k < rows) and columns [col_offset, col_offset + cols)
    of logical table ``table``, held by ``rank``."""

    table: str
    kind: str
    rank: int
    rows: int
    row_offset: int
    row_stride: int
    col_offset: int
    cols: int

    def local_spec(self, spec: TableSpec) -> TableSpec:
        """The shard as a sparsecore table: its own rows and columns, sum-pooled (the combiner is
        folded into per-id gains before the input dist, as the SparseCore host does)."""
        return replace(spec, vocab_size=self.rows, dim=self.cols, combiner="sum", initializer=None)

    @property
    def column_block(self) -> int:
        """Which column block the shard is (0 unless column_wise)."""
        return self.col_offset // self.cols if self.kind == "column_wise" else 0

    def rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """A view of this shard's rows (all columns) of a full [vocab, dim] tensor, or of its
        entries of a full row slot (the shard's column block of it)."""
        if full.dim() == 1:
            full = full[self.column_block * self.rows:]
        return full[self.row_offset::self.row_stride][: self.rows]

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's part of a full [vocab, dim] (or row-slot, :func:`row_slot_size`) tensor."""
        rows = self.rows_of(full)
        return (rows if full.dim() == 1 else rows[:, self.col_offset:self.col_offset + self.cols]).contiguous()

    def owns(self, ids: np.ndarray) -> np.ndarray:
        """Mask of the global ids that fall in this shard."""
        if self.kind != "row_wise":
            return np.ones(ids.shape, dtype=bool)
        return ids % self.row_stride == self.row_offset

    def local_rows(self, ids: np.ndarray) -> np.ndarray:
        return ids // self.row_stride if self.kind == "row_wise" else ids


def row_slot_size(table: TableSpec, shards: Sequence[Shard]) -> int:
    """Entries of a full row slot of ``table``: one per row, per column block."""
    return table.vocab_size * (table.dim // shards[0].cols if shards[0].kind == "column_wise" else 1)


def make_shards(tables: Sequence[TableSpec], sharding: Mapping[str, TableSharding],
                world_size: int) -> dict[str, list[Shard]]:
    """Every table's shards, in rank order (column order for column_wise)."""
    unknown = sorted(set(sharding) - {t.name for t in tables})
    if unknown:
        raise ValueError(f"sharding names unknown tables {unknown}")
    out = {}
    for table in tables:
        if table.name not in sharding:
            raise ValueError(f"table {table.name!r} has no sharding; give one of {SHARDING_TYPES}")
        out[table.name] = _table_shards(table, sharding[table.name], world_size)
    return out


def _table_shards(table: TableSpec, how: TableSharding, world_size: int) -> list[Shard]:
    where = f"table {table.name!r} ({how.kind})"
    for rank in how.ranks:
        if not 0 <= rank < world_size:
            raise ValueError(f"{where}: rank {rank} outside the world of {world_size}")
    full = dict(table=table.name, kind=how.kind, rows=table.vocab_size, row_offset=0, row_stride=1,
                col_offset=0, cols=table.dim)
    if how.kind == "table_wise":
        if len(how.ranks) != 1:
            raise ValueError(f"{where}: needs exactly one owner rank, got {how.ranks}")
        return [Shard(rank=how.ranks[0], **full)]
    if how.kind == "data_parallel":
        return [Shard(rank=r, **full) for r in range(world_size)]
    if how.kind == "row_wise":
        if table.vocab_size < world_size:
            raise ValueError(f"{where}: {table.vocab_size} rows cannot be split over {world_size} ranks")
        return [Shard(table.name, how.kind, r, (table.vocab_size - r + world_size - 1) // world_size, r,
                      world_size, 0, table.dim) for r in range(world_size)]
    return _column_shards(table, how, where, full)


def _column_shards(table: TableSpec, how: TableSharding, where: str, full: dict) -> list[Shard]:
    if len(set(how.ranks)) != len(how.ranks) or len(how.ranks) < 1:
        raise ValueError(f"{where}: needs distinct ranks, got {how.ranks}")
    if table.dim % len(how.ranks):
        raise ValueError(f"{where}: dim {table.dim} does not split evenly over {len(how.ranks)} ranks")
    cols = table.dim // len(how.ranks)
    return [Shard(**{**full, "rank": r, "col_offset": i * cols, "cols": cols}) for i, r in enumerate(how.ranks)]


def balanced_table_wise(tables: Sequence[TableSpec], world_size: int) -> dict[str, TableSharding]:
    """Whole tables on ranks, largest first onto the least-loaded rank (by parameters)."""
    load = [0] * world_size
    out = {}
    for table in sorted(tables, key=lambda t: (-t.vocab_size * t.dim, t.name)):
        rank = load.index(min(load))
        load[rank] += table.vocab_size * table.dim
        out[table.name] = TableSharding("table_wise", (rank,))
    return out
