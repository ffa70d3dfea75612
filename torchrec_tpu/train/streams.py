"""What ``train``'s TorchRec/MLPerf data flags do to the batch streams, as re-iterable wrappers.

Each wrapper is as long as what it yields and has ``iter_from_row(row)``, so the loop's resume
(a position in rows of the epoch's stream) sees the same batches an uninterrupted run would:

- :class:`ShuffledBatches` (``--shuffle-batches``): the epoch's batches in a random order seeded
  by (seed, epoch); each pass over it is the next epoch.
- :class:`LimitedBatches` (``--limit-train-batches`` / ``--limit-val-batches``): the first N.
- :class:`MultiHotBatches` (``--multi-hot-sizes``): MLPerf DLRM-DCNv2's synthetic multi-hot,
  each id ``x`` of a feature with size k becoming ``(x + offset[x mod C][j]) mod table_rows`` (the
  table's rows) for j < k, offset[.][0] = 0 (the id itself), other offsets fixed uniform random draws.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.streams import BatchStream, batches_from_row
from torchrec_tpu.train.config import TrainConfig
from tpu_facts import local_batch_of

OFFSET_ROWS = 100_000  # distinct offset vectors per feature (MLPerf's cache of multi-hot offsets)


class ShuffledBatches(BatchStream):
    """``batches`` in a new random order each epoch; ``epoch`` is the first pass's epoch."""

    def __init__(self, batches: Iterable[Batch], seed: int, epoch: int = 0) -> None:
        self.batches, self.seed, self.epoch = batches, seed, epoch

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from_row(0)

    def iter_from_row(self, row: int) -> Iterator[Batch]:
        """This epoch's shuffled stream from row ``row`` on (its first ``row`` rows are read and
        dropped: the order depends on the whole epoch); the next call is the next epoch."""
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self))
        self.epoch += 1
        return batches_from_row(self._in_order(order), row)

    def _in_order(self, order: np.ndarray) -> Iterator[Batch]:
        batches = list(self.batches)  # one epoch in memory, as TorchRec's in-memory Criteo loader
        for index in order:
            yield batches[index]


class LimitedBatches(BatchStream):
    """The first ``limit`` batches of ``batches`` (of ``local_batch`` rows each: one rank's)."""

    def __init__(self, batches: Iterable[Batch], limit: int, local_batch: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.batches, self.limit, self.local_batch = batches, limit, local_batch

    def __len__(self) -> int:
        return min(len(self.batches), self.limit)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from_row(0)

    def iter_from_row(self, row: int) -> Iterator[Batch]:
        return itertools.islice(batches_from_row(self.batches, row), max(0, self.limit - row // self.local_batch))


class MultiHotIds:
    """Each one-hot id of feature i expanded to ``sizes[i]`` ids: the id itself, then fixed random
    offsets of it (drawn from ``seed``) modulo its table's rows; what ``--multi-hot-sizes`` trains
    on, and what ``infer`` scores a checkpoint trained so with."""

    def __init__(self, sizes: Sequence[int], table_sizes: Sequence[int], seed: int) -> None:
        if len(sizes) != len(table_sizes):
            raise ValueError(f"{len(sizes)} multi-hot sizes for {len(table_sizes)} features")
        rng = np.random.default_rng([seed, 0x4D48])
        self.sizes, self.table_sizes = tuple(sizes), tuple(table_sizes)
        self.offsets = []
        for size, table_rows in zip(sizes, table_sizes):
            offsets = rng.integers(0, table_rows, size=(min(OFFSET_ROWS, table_rows), size), dtype=np.int64)
            offsets[:, 0] = 0
            self.offsets.append(offsets)

    def __call__(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        values, lengths = [], []
        for key, size, table_rows, offsets in zip(kjt.keys(), self.sizes, self.table_sizes, self.offsets):
            jagged = kjt[key]
            ids = jagged.values().numpy().astype(np.int64)
            expanded = (ids[:, None] + offsets[ids % len(offsets)]) % table_rows
            values.append(expanded.reshape(-1))
            lengths.append(jagged.lengths().numpy().astype(np.int32) * size)
        return KeyedJaggedTensor(keys=kjt.keys(), values=torch.from_numpy(np.concatenate(values)),
                                 lengths=torch.from_numpy(np.concatenate(lengths)))


class MultiHotBatches(BatchStream):
    """``batches`` with each one-hot id of feature i expanded to ``sizes[i]`` ids (:class:`MultiHotIds`)."""

    def __init__(self, batches: Iterable[Batch], sizes: Sequence[int], table_sizes: Sequence[int],
                 seed: int) -> None:
        self.batches, self.expand_ids = batches, MultiHotIds(sizes, table_sizes, seed)

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from_row(0)

    def iter_from_row(self, row: int) -> Iterator[Batch]:
        return (self.expand(batch) for batch in batches_from_row(self.batches, row))

    def expand(self, batch: Batch) -> Batch:
        return Batch(dense_features=batch.dense_features, sparse_features=self.expand_ids(batch.sparse_features),
                     labels=batch.labels)


def training_streams(config: TrainConfig, train: Iterable[Batch], held_out: Iterable[Batch], table_sizes: Sequence[int],
                     world_size: int, epoch: int) -> tuple[Iterable[Batch], Iterable[Batch]]:
    """(train, held-out) streams as ``config``'s flags ask; ``epoch``: where training starts."""
    multi_hot = config.per_feature("multi_hot_sizes", len(table_sizes))
    if config.data.shuffle_batches:
        train = ShuffledBatches(train, config.loop.seed, epoch)
    data = config.data
    if data.limit_train_batches:
        train = LimitedBatches(train, data.limit_train_batches, local_batch_of(data.batch_size, world_size))
    if multi_hot is not None:
        train = MultiHotBatches(train, multi_hot, table_sizes, config.loop.seed)
    return train, evaluation_stream(config, held_out, table_sizes, world_size)


def evaluation_stream(config: TrainConfig, batches: Iterable[Batch], table_sizes: Sequence[int],
                      world_size: int) -> Iterable[Batch]:
    """A held-out (validation or test) stream as ``config``'s flags ask."""
    multi_hot = config.per_feature("multi_hot_sizes", len(table_sizes))
    data = config.data
    if data.limit_val_batches:
        batches = LimitedBatches(batches, data.limit_val_batches, local_batch_of(data.eval_batch_size, world_size))
    if multi_hot is not None:
        batches = MultiHotBatches(batches, multi_hot, table_sizes, config.loop.seed)
    return batches
