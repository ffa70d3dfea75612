"""Ray Data input path: Parquet -> ``map_batches`` preprocessing -> ``Batch`` on the training device.

The plain pyarrow reader (:class:`pipelines.parquet_reader.ParquetBatchReader`) stays the default;
this path is for when preprocessing should run in parallel Ray workers and ranks should pull rows
from one shared stream (``streaming_split``) instead of owning a fixed row range.

Stages:

1. :func:`read_dataset`: one Ray task per Parquet row group (the groups indexed by
   :class:`ParquetBatchReader`, which also checks the columns). Not ``ray.data.read_parquet``:
   in this stack (ray 2.60, fsspec without aiohttp) its path resolution fails on a second read
   with an ImportError; row-group units also keep the reader free of fsspec.
2. :func:`preprocess`: run inside ``map_batches`` by the Ray workers; converts rows in the Parquet
   layout with :func:`pipelines.arrow_batch.batch_from_arrow` (the one place that defines the
   dense transform and id hashing) and re-encodes the Batch as a *row-aligned* Arrow table, the
   "model layout", which Ray can cut and concatenate into training batches of any size:

   * ``label``: float32, ``dense``: fixed_size_list<float32>[num_dense] (already transformed),
   * ``lengths``: fixed_size_list<int32>[num_sparse], the bag length of each categorical,
   * ``ids``: list<int64>, the row's hashed ids, key by key (row-major).

3. :class:`RayBatchStream`: ``iter_batches`` of model-layout rows -> :func:`batch_from_model_layout`
   (key-major KJT, as TorchRec wants) -> ``Batch.to(device)``; the device is ``tpu`` when
   ``torch_tpu`` is importable, ``cpu`` otherwise (:func:`default_device`).

Row accounting: ``streaming_split(n, equal=False)`` hands every row to exactly one split;
``equal=True`` (lock-step training) gives every split the same number of full batches: fewer than
``batch_size`` rows per split are dropped at the end of the stream, none is duplicated.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.arrow_batch import TableSizes, batch_from_arrow, table_sizes_for
from pipelines.bad_values import Source, apply_policy
from pipelines.parquet_reader import ParquetBatchReader, RowGroup, read_row_group
from pipelines.schema import CRITEO, DatasetSchema

if TYPE_CHECKING:
    import ray.data

DEFAULT_NUM_CPUS = 2
DEFAULT_OBJECT_STORE_BYTES = 300 * 1024**2
MODEL_LAYOUT_COLUMNS = ("label", "dense", "lengths", "ids")


@contextlib.contextmanager
def local_ray(
    num_cpus: int = DEFAULT_NUM_CPUS, object_store_memory: int = DEFAULT_OBJECT_STORE_BYTES,
    log_to_driver: bool = False,
    worker_setup: str = "pipelines.ray_data.pin_ray_address", env_vars: Mapping[str, str] | None = None,
) -> Iterator[None]:
    """A private Ray instance in this process for the ``with`` body, shut down at exit.

    Reuses an instance that is already initialised (its owner shuts it down). ``address="local"``
    never attaches to another user's cluster on a shared machine. Its session lives in a private
    temporary directory that a watchdog removes, with every Ray process, when this process exits
    in any way, SIGKILL included (:mod:`pipelines.ray_session`). Ray logs only errors here; its
    own logs stay in the session directory while it runs. ``log_to_driver``: the workers' output
    is printed here too (Ray Train's ranks). ``worker_setup``: the import path of Ray's
    ``worker_process_setup_hook``, run in every worker; it must call :func:`pin_ray_address`.
    ``env_vars``: set in every worker process of the instance.

    The instance is pinned as the one this job talks to (``RAY_ADDRESS``, here and in its workers):
    code that looks a Ray instance up by itself, such as Ray Train's placement-group cleaner,
    would otherwise fail with "Found multiple active Ray instances" beside another instance on
    the host, or attach to that one.
    """
    import logging

    import ray

    from pipelines.ray_session import ray_temp_dir

    if ray.is_initialized():
        yield
        return
    if num_cpus < 1:
        raise ValueError(f"num_cpus must be >= 1, got {num_cpus}")
    with ray_temp_dir() as temp_dir:
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        ray.init(
            address="local",
            num_cpus=num_cpus,
            object_store_memory=object_store_memory,
            include_dashboard=False,
            log_to_driver=log_to_driver,
            logging_level=logging.ERROR,
            logging_config=ray.LoggingConfig(log_level="ERROR"),  # the workers' loggers too
            runtime_env={"worker_process_setup_hook": worker_setup, "env_vars": dict(env_vars or {})},
            _temp_dir=temp_dir,
        )
        try:
            with pinned_ray_address():
                yield
        finally:
            ray.shutdown()


RAY_ADDRESS = "RAY_ADDRESS"


@contextlib.contextmanager
def pinned_ray_address() -> Iterator[None]:
    """:func:`pin_ray_address` for the ``with`` body; ``RAY_ADDRESS`` as it was afterwards."""
    previous = os.environ.get(RAY_ADDRESS)
    pin_ray_address()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RAY_ADDRESS, None)
        else:
            os.environ[RAY_ADDRESS] = previous


def pin_ray_address() -> None:
    """Point ``RAY_ADDRESS`` of this process (driver or worker, connected to Ray) at its own Ray
    instance, so that nothing in it looks for, or finds, another instance on the host."""
    import ray

    os.environ[RAY_ADDRESS] = ray.get_runtime_context().gcs_address


def default_device() -> torch.device:
    """``tpu:0`` when the torch_tpu package is importable, else ``cpu``."""
    if importlib.util.find_spec("torch_tpu") is None:
        return torch.device("cpu")
    import torch_tpu  # noqa: F401  (registers the device)

    return torch.device("tpu", 0)


def row_groups(paths: str | Path | Sequence[str | Path], schema: DatasetSchema = CRITEO) -> list[RowGroup]:
    """The row groups of the Parquet files (a directory's ``*.parquet`` sorted by name), in order,
    with their global first row; raises if a file lacks a column of ``schema``."""
    return ParquetBatchReader(paths, 1, (1,) * len(schema.sparse), schema).row_groups


def _read_row_groups(units: dict[str, np.ndarray], schema: DatasetSchema, bad_values: str) -> pa.Table:
    tables = [
        apply_policy(read_row_group(Path(path), int(index), schema.column_names), schema, bad_values,
                     Source(str(path), int(file_row)))
        for path, index, file_row in zip(units["path"], units["row_group"], units["file_row"])
    ]
    return pa.concat_tables(tables, promote_options="permissive")


def read_dataset(
    paths: str | Path | Sequence[str | Path], schema: DatasetSchema = CRITEO, bad_values: str = "error"
) -> "ray.data.Dataset":
    """The schema's columns of the Parquet files, one block per row group read by a Ray task,
    ``bad_values`` applied (:mod:`pipelines.bad_values`; skip counts stay in the workers)."""
    import ray.data

    groups = row_groups(paths, schema)
    units = ray.data.from_items(
        [{"path": str(group.path), "row_group": group.index, "file_row": group.file_row} for group in groups],
        override_num_blocks=len(groups),
    )
    return units.map_batches(
        _read_row_groups, batch_size=1, batch_format="numpy",
        fn_kwargs={"schema": schema, "bad_values": bad_values},
    )


def _row_major_positions(key_major_lengths: np.ndarray) -> np.ndarray:
    """For ``lengths[k, i]`` (key k, sample i), where each key-major value sits in row-major order.

    Row-major order lists sample 0's ids of key 0, 1, ..., then sample 1's, and so on. The result
    ``dest`` is a permutation: ``row_major[dest] = key_major`` and ``key_major = row_major[dest]``.
    """
    lengths = key_major_lengths.astype(np.int64, copy=False)
    flat_km = lengths.ravel()
    km_start = np.cumsum(flat_km) - flat_km
    rm_flat = lengths.T.ravel()
    rm_start = (np.cumsum(rm_flat) - rm_flat).reshape(lengths.shape[1], lengths.shape[0]).T.ravel()
    return np.repeat(rm_start - km_start, flat_km) + np.arange(int(flat_km.sum()), dtype=np.int64)


def preprocess(
    table: pa.Table, table_sizes: TableSizes, schema: DatasetSchema = CRITEO
) -> pa.Table:
    """Rows in the Parquet layout -> the model layout (module docstring); runs in Ray workers."""
    batch = batch_from_arrow(table, table_sizes, schema)
    num_rows, num_keys = table.num_rows, len(schema.sparse)
    kjt = batch.sparse_features
    km_lengths = kjt.lengths().numpy().reshape(num_keys, num_rows)
    ids = np.empty(kjt.values().numel(), dtype=np.int64)
    ids[_row_major_positions(km_lengths)] = kjt.values().numpy()
    row_lengths = km_lengths.sum(axis=0, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(row_lengths)]).astype(np.int32)
    dense = batch.dense_features.numpy()
    return pa.table({
        "label": batch.labels.numpy(),
        "dense": pa.FixedSizeListArray.from_arrays(dense.ravel(), dense.shape[1]),
        "lengths": pa.FixedSizeListArray.from_arrays(
            np.ascontiguousarray(km_lengths.T).ravel(), num_keys
        ),
        "ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
    })


def _flat_values(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    if not chunks:
        return np.empty(0)
    return np.concatenate([chunk.flatten().to_numpy(zero_copy_only=False) for chunk in chunks])


def batch_from_model_layout(table: pa.Table, schema: DatasetSchema = CRITEO) -> Batch:
    """Model-layout rows (see :func:`preprocess`) -> a Batch with a key-major KJT."""
    missing = [name for name in MODEL_LAYOUT_COLUMNS if name not in table.column_names]
    if missing:
        raise KeyError(f"model-layout table lacks columns {missing} (has {table.column_names})")
    num_rows, num_keys = table.num_rows, len(schema.sparse)
    dense = _flat_values(table.column("dense")).astype(np.float32, copy=False)
    rm_lengths = _flat_values(table.column("lengths")).astype(np.int32, copy=False)
    if dense.size != num_rows * len(schema.dense) or rm_lengths.size != num_rows * num_keys:
        raise ValueError(
            f"model-layout rows have {dense.size // max(num_rows, 1)} dense values and "
            f"{rm_lengths.size // max(num_rows, 1)} lengths per row; the schema has "
            f"{len(schema.dense)} dense and {num_keys} categorical columns"
        )
    km_lengths = np.ascontiguousarray(rm_lengths.reshape(num_rows, num_keys).T)
    ids = _flat_values(table.column("ids")).astype(np.int64, copy=False)
    labels = table.column("label").to_numpy().astype(np.float32)
    return Batch(
        dense_features=torch.from_numpy(dense.reshape(num_rows, len(schema.dense))),
        sparse_features=KeyedJaggedTensor(
            keys=list(schema.sparse),
            values=torch.from_numpy(ids[_row_major_positions(km_lengths)]),
            lengths=torch.from_numpy(km_lengths.ravel()),
        ),
        labels=torch.from_numpy(labels),
    )


def preprocessed_dataset(
    paths: str | Path | Sequence[str | Path],
    num_embeddings_per_feature: TableSizes,
    schema: DatasetSchema = CRITEO,
    bad_values: str = "error",
) -> "ray.data.Dataset":
    """:func:`read_dataset` followed by :func:`preprocess` in ``map_batches`` (one call per block)."""
    sizes = table_sizes_for(schema, num_embeddings_per_feature)
    return read_dataset(paths, schema, bad_values).map_batches(
        preprocess,
        batch_format="pyarrow",
        batch_size=None,
        zero_copy_batch=True,
        fn_kwargs={"table_sizes": sizes, "schema": schema},
    )


class RayBatchStream:
    """Iterable of Batches of ``batch_size`` rows from a model-layout Dataset or one of its splits.

    Each pass iterates the source again (a ``streaming_split`` iterator supports one pass per
    epoch, in step with its sibling splits). ``num_batches``, when given, is what ``len()`` says
    (a split's length is not known before it is read).
    """

    def __init__(
        self,
        source: "ray.data.Dataset | ray.data.DataIterator",
        batch_size: int,
        schema: DatasetSchema = CRITEO,
        device: torch.device | None = None,
        drop_last: bool = False,
        prefetch_batches: int = 2,
        num_batches: int | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.source = source
        self.batch_size = batch_size
        self.schema = schema
        self.device = default_device() if device is None else device
        self.drop_last = drop_last
        self.prefetch_batches = prefetch_batches
        self.num_batches = num_batches

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("the length of this Ray batch stream is unknown (no num_batches given)")
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        tables: Iterable[Any] = self.source.iter_batches(
            batch_size=self.batch_size,
            batch_format="pyarrow",
            drop_last=self.drop_last,
            prefetch_batches=self.prefetch_batches,
        )
        for table in tables:
            yield batch_from_model_layout(table, self.schema).to(self.device)


def split_streams(
    dataset: "ray.data.Dataset",
    world_size: int,
    batch_size: int,
    schema: DatasetSchema = CRITEO,
    device: torch.device | None = None,
    equal: bool = False,
) -> list[RayBatchStream]:
    """One stream per rank over ``dataset.streaming_split(world_size)``; all must be consumed
    concurrently (threads, or Ray actors receiving the stream)."""
    if world_size <= 0:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return [
        RayBatchStream(split, batch_size, schema, device, drop_last=equal)
        for split in dataset.streaming_split(world_size, equal=equal)
    ]
