"""Column schema of a click-log dataset (Criteo by default) and its Parquet layout.

The Parquet layout stores raw values; the dense transform and id hashing happen in the reader:

* label: int8 (0/1 clicks) or float32,
* dense columns: nullable int64, raw counts as they appear in the logs,
* categorical columns: nullable int64 (single-hot) or ``list<int64>`` (multi-hot).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26


@dataclass(frozen=True)
class DatasetSchema:
    """Names of the label, dense and categorical columns, and which categoricals are multi-hot."""

    label: str
    dense: tuple[str, ...]
    sparse: tuple[str, ...]
    multi_hot: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        names = self.column_names
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"schema has duplicated column names: {duplicated}")
        unknown = sorted(set(self.multi_hot) - set(self.sparse))
        if unknown:
            raise ValueError(f"multi_hot names {unknown} are not categorical columns {self.sparse}")

    @property
    def column_names(self) -> list[str]:
        """Columns in file order: label, dense, categorical."""
        return [self.label, *self.dense, *self.sparse]

    def is_multi_hot(self, name: str) -> bool:
        return name in self.multi_hot

    def with_multi_hot(self, names: frozenset[str] | set[str] | tuple[str, ...]) -> DatasetSchema:
        """The same columns with ``names`` stored as ``list<int64>``."""
        return DatasetSchema(self.label, self.dense, self.sparse, frozenset(names))

    def arrow_schema(self, label_type: pa.DataType = pa.int8()) -> pa.Schema:
        """The Parquet layout of this schema (label int8 by default, float32 for soft labels)."""
        if label_type not in (pa.int8(), pa.float32()):
            raise ValueError(f"label type must be int8 or float32, got {label_type}")
        fields = [pa.field(self.label, label_type, nullable=False)]
        fields += [pa.field(name, pa.int64()) for name in self.dense]
        fields += [
            pa.field(name, pa.list_(pa.int64()) if self.is_multi_hot(name) else pa.int64())
            for name in self.sparse
        ]
        return pa.schema(fields)


def criteo_schema(multi_hot: frozenset[str] | set[str] = frozenset()) -> DatasetSchema:
    """The Criteo Display Advertising / 1TB schema: ``label``, ``I1..I13``, ``C1..C26``."""
    return DatasetSchema(
        label="label",
        dense=tuple(f"I{i}" for i in range(1, CRITEO_NUM_DENSE + 1)),
        sparse=tuple(f"C{i}" for i in range(1, CRITEO_NUM_SPARSE + 1)),
        multi_hot=frozenset(multi_hot),
    )


CRITEO = criteo_schema()
