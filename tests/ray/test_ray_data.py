"""Ray Data path vs the plain pyarrow reader: same Batches, exactly-once splits, device placement."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.datasets.utils import Batch

from pipelines.arrow_batch import batch_from_arrow
from pipelines.parquet_reader import ParquetBatchReader
from pipelines.ray_data import (
    RayBatchStream,
    batch_from_model_layout,
    preprocess,
    preprocessed_dataset,
    split_streams,
)
from tests.ray.conftest import KEYED_ROWS, SMALL

KEYED_SIZES = (KEYED_ROWS + 1,) + (100,) * 25  # C1's table holds every row index unhashed


def assert_same_batch(actual: Batch, expected: Batch) -> None:
    torch.testing.assert_close(actual.dense_features, expected.dense_features, rtol=0, atol=0)
    torch.testing.assert_close(actual.labels, expected.labels, rtol=0, atol=0)
    a, e = actual.sparse_features, expected.sparse_features
    assert a.keys() == e.keys()
    assert torch.equal(a.lengths().to(torch.int64), e.lengths().to(torch.int64))
    assert torch.equal(a.values(), e.values())


def test_model_layout_round_trip_matches_arrow_batch(small_dataset: Path) -> None:
    """preprocess -> batch_from_model_layout is the identity on Batches (multi-hot, nulls)."""
    table = pq.read_table(sorted(small_dataset.glob("*.parquet"))[0])
    expected = batch_from_arrow(table, SMALL.table_sizes, SMALL.schema)
    layout = preprocess(table, SMALL.table_sizes, SMALL.schema)
    assert layout.column_names == ["label", "dense", "lengths", "ids"]
    # Row 0's ids, read by hand from the key-major KJT, sit first in the row-major ids column.
    kjt = expected.sparse_features
    row0 = [kjt[key].to_dense()[0].tolist() for key in kjt.keys()]
    assert layout.column("ids")[0].as_py() == [i for ids in row0 for i in ids]
    assert layout.column("lengths")[0].as_py() == [len(ids) for ids in row0]
    assert_same_batch(batch_from_model_layout(layout, SMALL.schema), expected)


def test_ray_stream_equals_pyarrow_reader(ray_session, small_dataset: Path) -> None:
    import ray.data

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    try:
        dataset = preprocessed_dataset(small_dataset, SMALL.table_sizes, SMALL.schema)
        stream = RayBatchStream(dataset, 256, SMALL.schema, device=torch.device("cpu"))
        actual = list(stream)
    finally:
        context.execution_options.preserve_order = False
    expected = list(ParquetBatchReader(small_dataset, 256, SMALL.table_sizes, SMALL.schema))
    assert [len(b.labels) for b in actual] == [len(b.labels) for b in expected]
    for got, want in zip(actual, expected):
        assert_same_batch(got, want)


def _consume(stream: RayBatchStream, out: list[np.ndarray], sizes: list[int]) -> None:
    for batch in stream:
        out.append(batch.sparse_features["C1"].values().cpu().numpy())
        sizes.append(len(batch.labels))


def _row_ids_per_split(dataset_dir: Path, world_size: int, equal: bool) -> list[np.ndarray]:
    dataset = preprocessed_dataset(dataset_dir, KEYED_SIZES)
    streams = split_streams(dataset, world_size, 128, device=torch.device("cpu"), equal=equal)
    outputs: list[list[np.ndarray]] = [[] for _ in streams]
    sizes: list[list[int]] = [[] for _ in streams]
    threads = [threading.Thread(target=_consume, args=(s, o, z)) for s, o, z in
               zip(streams, outputs, sizes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert all(not thread.is_alive() for thread in threads)
    for rank_sizes in sizes:  # full batches except possibly the last one
        assert all(size == 128 for size in rank_sizes[:-1]), rank_sizes
    return [np.concatenate(o) if o else np.empty(0, np.int64) for o in outputs]


def test_streaming_split_hands_every_row_to_exactly_one_rank(ray_session, keyed_dataset) -> None:
    per_rank = _row_ids_per_split(keyed_dataset, 3, equal=False)
    assert all(len(ids) > 0 for ids in per_rank)  # every rank got work
    everything = np.sort(np.concatenate(per_rank))
    np.testing.assert_array_equal(everything, np.arange(KEYED_ROWS))


def test_equal_split_balances_without_duplicates(ray_session, keyed_dataset) -> None:
    per_rank = _row_ids_per_split(keyed_dataset, 2, equal=True)
    assert len(per_rank[0]) == len(per_rank[1])
    everything = np.concatenate(per_rank)
    assert len(np.unique(everything)) == len(everything)
    # Lock-step: only full batches, the same count per rank; less than one batch per rank is lost.
    assert len(per_rank[0]) % 128 == 0
    assert KEYED_ROWS - 2 * 128 < len(everything) <= KEYED_ROWS


def test_batches_land_on_the_tpu_device(ray_session, small_dataset: Path) -> None:
    pytest.importorskip("torch_tpu")
    dataset = preprocessed_dataset(small_dataset, SMALL.table_sizes, SMALL.schema)
    stream = RayBatchStream(dataset.limit(300), 300, SMALL.schema)
    (batch,) = list(stream)
    assert stream.device == torch.device("tpu", 0)
    assert batch.dense_features.device.type == "tpu"
    assert batch.sparse_features.values().device.type == "tpu"
    assert batch.sparse_features.values().dtype == torch.int64
    cpu = batch.to(torch.device("cpu"))
    assert cpu.dense_features.shape == (300, len(SMALL.schema.dense))
    assert int(cpu.sparse_features.lengths().sum()) == cpu.sparse_features.values().numel()


def test_bad_layout_names_the_missing_columns(small_dataset: Path) -> None:
    table = pq.read_table(sorted(small_dataset.glob("*.parquet"))[0])
    with pytest.raises(KeyError, match="lacks columns"):
        batch_from_model_layout(table)


def test_training_loop_trains_on_ray_streams(ray_session, small_dataset: Path, tmp_path) -> None:
    """The training job's own loop and DMP model consume Ray streams: every row is trained on or
    evaluated once, and the evaluation matches the pyarrow reader's on the same weights."""
    from torchrec_tpu.train.config import OptimConfig
    from torchrec_tpu.train.distributed import process_group
    from torchrec_tpu.train.engines.torchrec_engine import build_optimizer, shard_model
    from torchrec_tpu.train.loop import LoopOptions, run_training
    from torchrec_tpu.train.metrics import evaluate
    from torchrec_tpu.train.model import ModelSpec, build_dlrm
    from torchrec_tpu.train.scalars import ScalarLog

    files = sorted(small_dataset.glob("*.parquet"))
    train_files, held_files = files[:-1], files[-1:]
    cpu = torch.device("cpu")
    optim = OptimConfig(sparse_optimizer="adagrad", sparse_lr=0.1, dense_optimizer="adagrad", dense_lr=0.05)
    spec = ModelSpec(SMALL.schema.sparse, SMALL.table_sizes, 8, len(SMALL.schema.dense), (16, 8),
                     (16, 1))

    def stream(paths: list[Path]) -> RayBatchStream:
        return RayBatchStream(preprocessed_dataset(paths, SMALL.table_sizes, SMALL.schema), 256,
                              SMALL.schema, cpu)

    torch.manual_seed(0)
    with process_group() as env, ScalarLog(tmp_path, enabled=False) as log:
        model = shard_model(build_dlrm(spec, cpu), env, cpu, optim, 256)
        optimizer = build_optimizer(model, optim)
        result = run_training(model, optimizer, stream(train_files), stream(held_files), cpu, log,
                              LoopOptions(log_every=4, progress=False))
        reference = evaluate(model, ParquetBatchReader(held_files, 256, SMALL.table_sizes,
                                                       SMALL.schema), cpu)
    held_rows = pq.ParquetFile(held_files[0]).metadata.num_rows
    assert result.samples == SMALL.num_rows - held_rows
    assert result.eval.samples == held_rows
    assert result.eval.auc == pytest.approx(reference.auc, abs=1e-6)
    assert result.eval.loss == pytest.approx(reference.loss, rel=1e-5)


def test_ray_reader_applies_the_bad_value_policy(ray_session, small_dataset: Path, tmp_path) -> None:
    """The same --bad-values rule as the pyarrow reader (pipelines.bad_values), file and row named."""
    import pyarrow as pa
    import ray.data

    data = tmp_path / "data"
    data.mkdir()
    parts = sorted(small_dataset.glob("*.parquet"))
    for part in parts:
        pq.write_table(pq.read_table(part), data / part.name, row_group_size=500)
    damaged = data / parts[1].name
    table = pq.read_table(damaged)
    labels = table.column("label").to_numpy().astype(np.float64)
    labels[700] = 3.0  # second row group of the file, row 200 of it
    pq.write_table(table.set_column(0, "label", pa.array(labels)), damaged, row_group_size=500)
    with pytest.raises(Exception, match=rf"{damaged}: row 700, column label: 3.0 is not a label"):
        list(RayBatchStream(preprocessed_dataset(data, SMALL.table_sizes, SMALL.schema), 512,
                            SMALL.schema, device=torch.device("cpu")))
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    try:
        stream = RayBatchStream(preprocessed_dataset(data, SMALL.table_sizes, SMALL.schema, bad_values="skip"),
                                512, SMALL.schema, device=torch.device("cpu"))
        got = np.concatenate([b.labels.numpy() for b in stream])
    finally:
        context.execution_options.preserve_order = False
    expected = np.concatenate([pq.read_table(p).column("label").to_numpy().astype(np.float32)
                               for p in sorted(data.glob("*.parquet"))])
    np.testing.assert_array_equal(got, np.delete(expected, 1_200 + 700))
