"""Batch streams as the training loop consumes them, whatever produces them.

* :class:`BatchStream`: what a batch stream is (re-iterable, its length in batches, seekable by
  row); every reader and wrapper declares it;
* :func:`prefetched`: an iterator run by a background thread a bounded number of items ahead
  (the Parquet reader's row groups, the train pipeline's input dists), errors re-raised in the
  consumer;
* :func:`batches_from_row`: a batch stream from a row on, seeking when the stream can
  (``iter_from_row``), which every resumable stream here implements.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from typing import Iterable, Iterator, Protocol, TypeVar, runtime_checkable

from torchrec.datasets.utils import Batch

T = TypeVar("T")
_DONE = object()
_abandoning = threading.local()


class _Bound:
    """How many items a :func:`prefetched` producer may start (no limit until its consumer stops)."""

    items: float = math.inf


@runtime_checkable
class BatchStream(Protocol):
    """A stream of training batches: iterating it again starts again from its first batch, ``len``
    is the number of batches one pass yields, and ``iter_from_row(row)`` yields the batches from row
    ``row`` of the pass on (a resume seeks instead of reading the rows before)."""

    def __len__(self) -> int:
        ...

    def __iter__(self) -> Iterator[Batch]:
        ...

    def iter_from_row(self, row: int) -> Iterator[Batch]:
        ...


@contextlib.contextmanager
def abandoning() -> Iterator[None]:
    """Lock-step streams (:func:`prefetched` with ``lockstep``) closed inside stop their producer
    after the item in hand: the consumer failed, and the other ranks may never join the
    collectives of the items a lock-step close would still produce. Use around ``close()``."""
    _abandoning.active = True
    try:
        yield
    finally:
        _abandoning.active = False


def prefetched(items: Iterator[T], depth: int, lockstep: bool = False) -> Iterator[T]:
    """``items`` produced by a background thread up to ``depth`` ahead (Parquet decoding releases
    the GIL, so it overlaps the conversion to tensors). Exceptions surface in the consumer.

    ``lockstep``: producing an item runs collectives with other processes that take as many
    items (the ranks' input dists). How far a producer has got when its consumer stops early
    differs between ranks, so a closed stream (outside :func:`abandoning`) has its producer finish
    exactly ``depth + 1`` items past the last one taken, the most any producer can have started:
    the same on every rank, so none waits in a collective another rank's producer never joins."""
    if depth <= 0:
        yield from items
        return
    slots: queue.Queue = queue.Queue(maxsize=depth)
    bound = _Bound()

    def produce() -> None:
        started = 0
        try:
            while started < bound.items:
                started += 1
                item = next(items, _DONE)
                if item is _DONE:
                    break
                slots.put(item)
            slots.put(_DONE)
        except BaseException as error:  # handed to the consumer, which re-raises it
            slots.put(error)

    worker = threading.Thread(target=produce, name="prefetch", daemon=True)
    worker.start()
    taken = 0
    try:
        while (item := slots.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            taken += 1
            yield item
    finally:
        in_step = lockstep and not getattr(_abandoning, "active", False)
        bound.items = taken + depth + 1 if in_step else 0
        while worker.is_alive():  # unblock a producer waiting on a full queue
            try:
                slots.get(timeout=0.01)
            except queue.Empty:
                pass
        worker.join()


def batches_from_row(batches: Iterable[Batch], row: int) -> Iterator[Batch]:
    """``batches`` from row ``row`` on: seeks when the stream has ``iter_from_row(row)`` (as
    :class:`ParquetBatchReader` does), else reads and drops the batches of the first ``row``
    rows, which must end on a batch boundary."""
    if isinstance(batches, BatchStream):
        return batches.iter_from_row(row)
    return _drop_rows(iter(batches), row)


def _drop_rows(batches: Iterator[Batch], row: int) -> Iterator[Batch]:
    skipped = 0
    while skipped < row:
        batch = next(batches, None)
        if batch is None:
            return
        skipped += batch.labels.numel()
    if skipped != row:
        raise ValueError(f"cannot start at row {row}: this batch stream cannot seek, and row {row} "
                         f"falls inside a batch (rows {skipped - batch.labels.numel()}-{skipped - 1})")
    yield from batches
