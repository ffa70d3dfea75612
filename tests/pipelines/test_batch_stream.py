"""One batch-stream contract (``pipelines.streams.BatchStream``) that every reader and wrapper
declares, and ``batches_from_row`` seeks any of them while skipping through a plain iterable."""

from __future__ import annotations

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.npy_criteo import NpyCriteoReader
from pipelines.parquet_reader import ParquetBatchReader
from pipelines.streams import BatchStream, batches_from_row
from torchrec_tpu.pipeline.prefetch import PrefetchedBatches
from torchrec_tpu.rank_agreement import AgreedBatches
from torchrec_tpu.train.streams import LimitedBatches, MultiHotBatches, ShuffledBatches

STREAMS = (NpyCriteoReader, ParquetBatchReader, PrefetchedBatches, AgreedBatches, ShuffledBatches,
           LimitedBatches, MultiHotBatches)


def _batch(first: int, rows: int = 2) -> Batch:
    ids = torch.arange(first, first + rows)
    sparse = KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.ones(rows, dtype=torch.int32))
    return Batch(ids.float()[:, None], sparse, ids.float())


class _Seekable(BatchStream):
    def __init__(self, batches: list[Batch]) -> None:
        self.batches, self.seeks = batches, []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return self.iter_from_row(0)

    def iter_from_row(self, row: int):
        self.seeks.append(row)
        return iter(self.batches[row // 2:])


def test_every_stream_declares_the_protocol() -> None:
    for cls in STREAMS:
        assert issubclass(cls, BatchStream), cls.__name__
        assert all(callable(getattr(cls, verb)) for verb in ("__len__", "__iter__", "iter_from_row"))


def test_batches_from_row_seeks_a_stream_and_skips_an_iterable() -> None:
    batches = [_batch(2 * i) for i in range(4)]
    stream = _Seekable(batches)
    assert isinstance(stream, BatchStream) and not isinstance(batches, BatchStream)
    assert [b.labels[0].item() for b in batches_from_row(stream, 4)] == [4.0, 6.0] and stream.seeks == [4]
    assert [b.labels[0].item() for b in batches_from_row(batches, 4)] == [4.0, 6.0]
