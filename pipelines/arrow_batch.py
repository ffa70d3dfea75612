"""One Arrow table / record batch in the Parquet layout -> ``torchrec.datasets.utils.Batch``.

Pinned conventions (every reader of this package goes through :func:`batch_from_arrow`):

* Dense: ``log(max(x, 0) + 1)`` in float32, missing (null, or NaN in a float column) -> 0. This is
  the MLPerf DLRM / TorchRec Criteo transform: raw counts are heavy-tailed (I5 reaches ~10^7), the
  log keeps them in a range an MLP trains on; negative values are rare sentinels (I2 = -1, -2, -3)
  and are clamped; a missing count maps to the same value as a zero count (log 1 = 0), as in the
  reference preprocessing.
* Sparse: a ``KeyedJaggedTensor`` with one key per categorical column, lengths key-major
  (``lengths[k * B + i]`` for key k, sample i). A missing single-hot value has length 0 (pooled
  embedding 0 under sum pooling), so no table row is reserved for "missing"; a null multi-hot list
  also has length 0. Ids are hashed into their table as ``id mod num_embeddings`` (floor modulo:
  the row is always in ``[0, num_embeddings)``, also for negative raw ids).
* Labels: float32[B].
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.schema import CRITEO, DatasetSchema

TableSizes = Sequence[int] | Mapping[str, int]
RAW_IDS = -1  # the table size of a feature whose ids are read as they are (int64; managed collisions remap them)


def table_sizes_for(schema: DatasetSchema, num_embeddings_per_feature: TableSizes) -> tuple[int, ...]:
    """Table sizes in ``schema.sparse`` order, validated (one positive size, or ``RAW_IDS``, per categorical)."""
    if isinstance(num_embeddings_per_feature, Mapping):
        missing = [name for name in schema.sparse if name not in num_embeddings_per_feature]
        if missing:
            raise ValueError(f"num_embeddings_per_feature has no size for {missing}")
        sizes = tuple(int(num_embeddings_per_feature[name]) for name in schema.sparse)
    else:
        sizes = tuple(int(n) for n in num_embeddings_per_feature)
        if len(sizes) != len(schema.sparse):
            raise ValueError(
                f"num_embeddings_per_feature has {len(sizes)} sizes, the schema has "
                f"{len(schema.sparse)} categorical columns"
            )
    for name, size in zip(schema.sparse, sizes):
        if size <= 0 and size != RAW_IDS:
            raise ValueError(f"table size of {name} must be > 0, got {size} (or {RAW_IDS}: raw ids)")
    return sizes


def dense_transform(raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``log(max(x, 0) + 1)`` in float32; NaN (a null, or a float column's NaN) counts as missing
    and maps to 0."""
    out = np.fmax(raw, 0, out=out, dtype=np.float32, casting="unsafe")
    return np.log1p(out, out=out)


def _column(data: pa.Table | pa.RecordBatch, name: str) -> pa.Array:
    if name not in data.schema.names:
        raise KeyError(f"column {name!r} missing from the data (columns: {data.schema.names})")
    column = data.column(name)
    if isinstance(column, pa.ChunkedArray):
        return column.chunk(0) if column.num_chunks == 1 else pa.concat_arrays(column.chunks)
    return column


def _numeric(column: pa.Array, name: str) -> pa.Array:
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise TypeError(f"column {name} must be numeric, got {column.type}")
    return column


def _ids_and_lengths(column: pa.Array, name: str) -> tuple[np.ndarray, np.ndarray]:
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        if not pa.types.is_integer(column.type.value_type):
            raise TypeError(f"multi-hot column {name} must hold integer ids, got {column.type}")
        ids = pc.list_flatten(column)
        if ids.null_count:
            raise ValueError(f"multi-hot column {name} has {ids.null_count} null ids inside lists")
        lengths = pc.fill_null(pc.list_value_length(column), 0)
        return ids.to_numpy(), lengths.to_numpy().astype(np.int32)
    if not pa.types.is_integer(column.type):
        raise TypeError(f"categorical column {name} must be integer or list<integer>, got {column.type}")
    if not column.null_count:  # the common case, without two Arrow kernel calls per column
        return column.to_numpy(), np.ones(len(column), dtype=np.int32)
    lengths = column.is_valid().to_numpy(zero_copy_only=False).astype(np.int32)
    return pc.drop_null(column).to_numpy(), lengths


def sparse_from_arrow(
    data: pa.Table | pa.RecordBatch, schema: DatasetSchema, table_sizes: Sequence[int]
) -> KeyedJaggedTensor:
    """The categorical columns as a KeyedJaggedTensor of ids hashed into their tables (a
    ``RAW_IDS`` table: cast to int64 as they are)."""
    per_key = [_ids_and_lengths(_column(data, name), name) for name in schema.sparse]
    values = np.empty(sum(len(ids) for ids, _ in per_key), dtype=np.int64)
    start = 0
    for (ids, _), size in zip(per_key, table_sizes):
        if size == RAW_IDS:
            values[start : start + len(ids)] = ids.astype(np.int64, copy=False)
        else:
            np.mod(ids, size, out=values[start : start + len(ids)], casting="unsafe")
        start += len(ids)
    return KeyedJaggedTensor(
        keys=list(schema.sparse),
        values=torch.from_numpy(values),
        lengths=torch.from_numpy(np.concatenate([lengths for _, lengths in per_key])),
    )


def empty_batch(schema: DatasetSchema) -> Batch:
    """A batch of no rows in ``schema``'s layout."""
    sparse = KeyedJaggedTensor(keys=list(schema.sparse), values=torch.zeros(0, dtype=torch.int64),
                               lengths=torch.zeros(0, dtype=torch.int32))
    return Batch(dense_features=torch.zeros(0, len(schema.dense)), sparse_features=sparse, labels=torch.zeros(0))


def dense_from_arrow(data: pa.Table | pa.RecordBatch, schema: DatasetSchema) -> torch.Tensor:
    """The dense columns as float32[B, len(schema.dense)] after :func:`dense_transform`."""
    by_column = np.empty((len(schema.dense), data.num_rows), dtype=np.float32)
    for j, name in enumerate(schema.dense):
        column = _numeric(_column(data, name), name)
        dense_transform(column.to_numpy(zero_copy_only=False), out=by_column[j])  # nulls: NaN, mapped to 0
    return torch.from_numpy(np.ascontiguousarray(by_column.T))


def labels_from_arrow(data: pa.Table | pa.RecordBatch, schema: DatasetSchema) -> torch.Tensor:
    column = _numeric(_column(data, schema.label), schema.label)
    if column.null_count:
        raise ValueError(f"label column {schema.label} has {column.null_count} missing labels")
    return torch.from_numpy(pc.cast(column, pa.float32()).to_numpy(zero_copy_only=False, writable=True))


def batch_from_arrow(
    data: pa.Table | pa.RecordBatch,
    num_embeddings_per_feature: TableSizes,
    schema: DatasetSchema = CRITEO,
) -> Batch:
    """Converts rows in the Parquet layout into a Batch (see the module docstring for the rules).

    Single-hot and multi-hot columns are told apart by their Arrow type, so a table may mix them.
    """
    sizes = table_sizes_for(schema, num_embeddings_per_feature)
    return Batch(
        dense_features=dense_from_arrow(data, schema),
        sparse_features=sparse_from_arrow(data, schema, sizes),
        labels=labels_from_arrow(data, schema),
    )
