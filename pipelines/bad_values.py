"""One policy for bad label and dense values, applied by every reader (train's Parquet and Ray
readers, ``infer``) to raw Arrow rows before the dense transform.

Bad values:

* a label outside ``[0, 1]`` (7.0, -3.0; soft labels in between are fine), NaN or null;
* a dense value that is infinite or beyond float32's range (``+inf``, ``-inf``, ``1e300``): the
  transform would turn it into ``inf`` and the loss into NaN;
* a null id inside a multi-hot list (``[3, null]``: no row to look up; a null list is missing).

NaN and null dense values are *missing* and map to 0 (:mod:`pipelines.arrow_batch`), they are not
bad. Integer dense columns cannot hold a bad value (int64 is within float32's range) and are not
scanned.

Policies (``--bad-values``):

* ``error`` (default): :class:`BadValueError` naming the file, the row (0-based, within the file),
  the column and the value;
* ``skip``: rows holding a bad value are dropped and counted;
* ``clamp``: dense values are clamped to float32's range (+-3.4e38, about 88.7 after the log
  transform) and labels to ``[0, 1]``; a NaN or null label or a null id cannot be clamped, so its
  row is skipped.

The check is a few vectorized numpy operations per float column of a table, nothing per row in
Python. :class:`BadValueLog` counts skipped and clamped rows once per (file, row) however often
they are read (epochs), and keeps the first few for the report.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.bad_value_policies import POLICIES
from pipelines.schema import DatasetSchema

FLOAT32_MAX = float(np.finfo(np.float32).max)
LISTED = 5  # bad rows a report names before "... and N more"


class BadValueError(ValueError):
    """A bad label or dense value under the ``error`` policy; names the file, row and column."""


@dataclass(frozen=True)
class Source:
    """Where a table's rows come from: row 0 of the table is row ``first_row`` of ``path``."""

    path: str
    first_row: int = 0


def _float_values(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """The column as float64 with nulls as NaN."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)


def _null_ids(table: pa.Table, schema: DatasetSchema) -> list[tuple[str, np.ndarray]]:
    """[(multi-hot column, mask of the rows holding a null id inside their list)]."""
    out = []
    for name in schema.sparse:
        if not _is_column(table, name, pa.types.is_list):
            continue
        column = table.column(name).combine_chunks()
        ids = pc.list_flatten(column)
        if ids.null_count:
            rows = pc.filter(pc.list_parent_indices(column), ids.is_null()).to_numpy()
            mask = np.zeros(table.num_rows, dtype=bool)
            mask[rows] = True
            out.append((name, mask))
    return out


def _is_column(table: pa.Table, name: str, kind: Callable[[pa.DataType], bool]) -> bool:
    """Whether ``table`` has a column ``name`` of ``kind`` (one lookup: ``column_names`` builds a list a call)."""
    index = table.schema.get_field_index(name)
    return index >= 0 and kind(table.schema.field(index).type)


def _scan(table: pa.Table, schema: DatasetSchema, label: bool) -> tuple[np.ndarray | None, list]:
    """(label values if the label is bad anywhere else None, [(dense name, bad mask, values)])."""
    labels = None
    if label and schema.label in table.column_names:
        values = _float_values(table.column(schema.label))
        if not np.all((values >= 0) & (values <= 1)):  # NaN fails both comparisons
            labels = values
    dense = []
    for name in schema.dense:
        if not _is_column(table, name, pa.types.is_floating):
            continue
        values = _float_values(table.column(name))
        bad = np.abs(values) > FLOAT32_MAX  # inf included, NaN (missing) not
        if bad.any():
            dense.append((name, bad, values))
    return labels, dense


def bad_labels(labels: np.ndarray) -> np.ndarray:
    """Mask of the labels outside ``[0, 1]`` or NaN (a null read as NaN)."""
    return ~((labels >= 0) & (labels <= 1))


def _describe(source: Source | None, row: int, column: str, value: float | None, why: str) -> str:
    where = f"{source.path}: row {source.first_row + row}" if source else f"row {row}"
    return f"{where}, column {column}: {why}" if value is None else f"{where}, column {column}: {value!r} {why}"


def _null_id_texts(holes: list[tuple[str, np.ndarray]], source: Source | None, exclude: np.ndarray) -> list[str]:
    return [_describe(source, int(r), name, None, _NULL_ID_WHY) for name, mask in holes
            for r in np.flatnonzero(mask & ~exclude)[:LISTED]]


LABEL_WHY = "is not a label in [0, 1]"
_DENSE_WHY = "is beyond float32's range (+-3.4e38)"
_NULL_ID_WHY = "a null id inside a multi-hot list"


@dataclass
class BadValueLog:
    """Rows skipped / clamped under a policy, each (file, row) counted once; thread-safe."""

    _rows: dict[tuple[str, str], set[int]] = field(default_factory=dict)  # (action, path) -> rows
    _listed: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, action: str, source: Source | None, rows: np.ndarray, descriptions: list[str]) -> None:
        path = source.path if source else ""
        offset = source.first_row if source else 0
        with self._lock:
            self._rows.setdefault((action, path), set()).update((rows + offset).tolist())
            for text in (f"{action} {d}" for d in descriptions):
                if len(self._listed) < LISTED and text not in self._listed:
                    self._listed.append(text)

    def counts(self) -> "BadValueCounts":
        with self._lock:
            total = {a: sum(len(rows) for (act, _), rows in self._rows.items() if act == a)
                     for a in ("skipped", "clamped")}
            return BadValueCounts(total["skipped"], total["clamped"], tuple(self._listed))


@dataclass(frozen=True)
class BadValueCounts:
    """What a policy did, picklable; ``+`` adds the counts of disjoint rows (other ranks)."""

    skipped: int = 0
    clamped: int = 0
    listed: tuple[str, ...] = ()

    def __add__(self, other: "BadValueCounts") -> "BadValueCounts":
        return BadValueCounts(self.skipped + other.skipped, self.clamped + other.clamped,
                              (self.listed + other.listed)[:LISTED])

    def lines(self) -> list[str]:
        """A summary line, the first rows, ``... and N more``; [] when nothing was skipped or clamped."""
        if not self.skipped and not self.clamped:
            return []
        parts = [f"skipped {_rows(self.skipped)}" if self.skipped else "",
                 f"clamped values in {_rows(self.clamped)}" if self.clamped else ""]
        out = ["bad values: " + ", ".join(p for p in parts if p)]
        out += [f"  {text}" for text in self.listed]
        if self.skipped + self.clamped > len(self.listed):
            out.append(f"  ... and {self.skipped + self.clamped - len(self.listed)} more")
        return out


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _first_rows(mask: np.ndarray, source: Source | None, column: str, values: np.ndarray, why: str) -> list[str]:
    return [_describe(source, int(r), column, float(values[r]), why) for r in np.flatnonzero(mask)[:LISTED]]


def apply_policy(table: pa.Table, schema: DatasetSchema, policy: str, source: Source | None = None,
                 log: BadValueLog | None = None, label: bool = True) -> pa.Table:
    """``table`` with the policy applied (the same table when nothing is bad); ``label=False``
    leaves the label alone (inference has none)."""
    if policy not in POLICIES:
        raise ValueError(f"bad-value policy must be one of {list(POLICIES)}, got {policy!r}")
    labels, dense = _scan(table, schema, label)
    holes = _null_ids(table, schema)
    if labels is None and not dense and not holes:
        return table
    label_bad = bad_labels(labels) if labels is not None else np.zeros(table.num_rows, dtype=bool)
    null_id = _any(holes, table.num_rows)
    if policy == "error":
        if label_bad.any():
            row = int(np.flatnonzero(label_bad)[0])
            first = _describe(source, row, schema.label, float(labels[row]), LABEL_WHY)
        elif dense:
            name, bad, values = dense[0]
            row = int(np.flatnonzero(bad)[0])
            first = _describe(source, row, name, float(values[row]), _DENSE_WHY)
        else:
            first = _null_id_texts(holes[:1], source, np.zeros(table.num_rows, dtype=bool))[0]
        total = int((label_bad | _any(dense, table.num_rows) | null_id).sum())
        more = f" ({total - 1} more bad rows in the same {table.num_rows} rows)" if total > 1 else ""
        raise BadValueError(f"{first}{more}; pass --bad-values skip or clamp to skip or clamp such rows")
    if policy == "skip":
        drop = label_bad | _any(dense, table.num_rows) | null_id
        if log is not None:
            texts = _first_rows(label_bad, source, schema.label, labels, LABEL_WHY) if labels is not None else []
            texts += [t for name, bad, values in dense
                      for t in _first_rows(bad & ~label_bad, source, name, values, _DENSE_WHY)]
            texts += _null_id_texts(holes, source, label_bad | _any(dense, table.num_rows))
            log.record("skipped", source, np.flatnonzero(drop), texts)
        return table.filter(pa.array(~drop))
    # clamp: labels into [0, 1] (NaN/null rows skipped), dense into float32's range, null ids skipped
    nan_label = np.isnan(labels) if labels is not None else label_bad
    unclampable = nan_label | null_id
    clamped_rows = (label_bad & ~unclampable) | _any(dense, table.num_rows)
    if labels is not None:
        table = _set(table, schema.label, np.clip(labels, 0.0, 1.0), pa.float32())
    for name, _, values in dense:
        table = _set(table, name, np.clip(values, -FLOAT32_MAX, FLOAT32_MAX), pa.float64())
    if log is not None:
        texts = [] if labels is None else _first_rows(clamped_rows & label_bad, source, schema.label, labels,
                                                      LABEL_WHY)
        texts += [t for name, bad, values in dense for t in _first_rows(bad, source, name, values, _DENSE_WHY)]
        log.record("clamped", source, np.flatnonzero(clamped_rows & ~unclampable), texts)
        if unclampable.any():
            texts = _first_rows(nan_label, source, schema.label, labels, LABEL_WHY) if labels is not None else []
            log.record("skipped", source, np.flatnonzero(unclampable), texts + _null_id_texts(holes, source, nan_label))
    return table.filter(pa.array(~unclampable)) if unclampable.any() else table


def kept_rows(table: pa.Table, schema: DatasetSchema, policy: str, label: bool = True) -> np.ndarray:
    """Mask of the rows ``apply_policy`` keeps (``error`` keeps all: it raises instead)."""
    if policy == "error":
        return np.ones(table.num_rows, dtype=bool)
    labels, dense = _scan(table, schema, label)
    null_id = _any(_null_ids(table, schema), table.num_rows)
    if policy == "clamp":
        return ~(np.isnan(labels) | null_id) if labels is not None else ~null_id
    label_bad = bad_labels(labels) if labels is not None else np.zeros(table.num_rows, dtype=bool)
    return ~(label_bad | _any(dense, table.num_rows) | null_id)


def _any(masks: list, num_rows: int) -> np.ndarray:
    """The union of the masks (each entry's second item) of ``masks``."""
    mask = np.zeros(num_rows, dtype=bool)
    for entry in masks:
        mask |= entry[1]
    return mask


def _set(table: pa.Table, name: str, values: np.ndarray, type_: pa.DataType) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, pa.array(values, type=type_))
