"""``PrefetchedBatches``: the role of TorchRec's TrainPipelineSparseDist without CUDA streams.

A background thread reads batch i+1..i+depth from the loader, moves it to the device and runs the
sharded EBC's input dist (validation, combiner gains, id routing, all_to_alls) while the caller's
thread trains on batch i. Each batch comes out with its sparse features as a
:class:`~torchrec_tpu.sharding.ebc.PrefetchedKJT`, which carries the input dist's result to the
EBC's forward. A bounded queue keeps at most ``depth`` batches in flight; loader and input-dist
errors re-raise in the caller's thread, where the batch would have been used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from pipelines.streams import BatchStream, batches_from_row, prefetched
from torchrec_tpu.errors import CollectiveError
from torchrec_tpu.rank_agreement import raise_first_failure
from torchrec_tpu.rank_watch import collectives
from torchrec_tpu.sharding import ShardedSparseCoreEBC
from torchrec_tpu.sharding.ebc import PrefetchedKJT


class PrefetchedBatches(BatchStream):
    """Re-iterable like ``batches`` (and as long); each pass runs its own prefetch thread.

    ``group``: the process group the prefetch thread's input dists use; with more than one rank
    it must be a group of its own (``dist.new_group()``), so they never interleave with the
    step's output-dist collectives on the default group. ``explain`` turns an input dist's
    error into the one reported (naming the caller's options).
    """

    def __init__(self, batches: Iterable[Batch], ebc: ShardedSparseCoreEBC, device: torch.device,
                 depth: int = 2, group: dist.ProcessGroup | None = None,
                 explain: Callable[[Exception], Exception] | None = None):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        if ebc.world_size > 1 and group is None:
            raise ValueError("with several ranks the prefetch thread needs its own process group (dist.new_group())")
        self.batches, self.ebc, self.device, self.depth, self.group = batches, ebc, device, depth, group
        self.explain = explain or (lambda error: error)

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from_row(0)

    def iter_from_row(self, row: int) -> Iterator[Batch]:
        """The batches from row ``row`` on (seeking the loader when it can); the rows before are
        never input-dist'ed. A new pass is an epoch boundary: FDO raises the limits exceeded so far."""
        if self.ebc.fdo is not None:
            self.ebc.fdo.tune()
        batches = iter(batches_from_row(self.batches, row))
        if self.group is None:
            return prefetched(self._prepared(batches), self.depth)
        return prefetched(self._agreed(batches), self.depth, lockstep=True)

    def _prepared(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """One rank, on the prefetch thread: read, move to the device, input dist."""
        for batch in batches:
            batch = batch.to(self.device)
            if batch.sparse_features.stride() == self.ebc.padded_local_batch:
                try:
                    batch = dataclasses.replace(batch, sparse_features=self.ebc.prefetch(batch.sparse_features))
                except Exception as error:
                    raise self.explain(error) from error
            yield batch

    def _agreed(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """Several ranks, on the prefetch thread: read, move to the device, input dist, where the
        ranks agree on each batch before any of them trains on it (:mod:`~torchrec_tpu.rank_agreement`)
        without collectives of their own: a batch's lengths all_to_all carries every rank's word
        that its reader gave it this batch and that the previous batch's input dist went well
        (it can fail on one rank only after the all_to_alls: a SparseCore partition over its
        limit), and, with FDO, that batch's partition maxima (:mod:`~torchrec_tpu.sharding.fdo`).
        A rank out of batches ends the pass on every rank; a rank's failure fails every rank at
        once with its message; a batch that is not of the padded size on some rank is not
        prefetched on any (its forward runs the input dist)."""
        ready, failure = None, None  # the batch input-dist'ed last, and its input dist's error here
        while True:
            batch, read_error = None, None
            try:
                batch = next(batches).to(self.device)
            except StopIteration:
                pass
            except Exception as error:  # noqa: BLE001  agreed on below, raised on every rank
                read_error = error
            whole = batch is not None and batch.sparse_features.stride() == self.ebc.padded_local_batch
            agreeing = "the sparse input all_to_all of a prefetched batch (its lengths, with the ranks' agreement)"
            with collectives(agreeing):
                sent = self.ebc.send_lengths(batch.sparse_features if whole else None, self.group,
                                             [failure is not None, read_error is not None, batch is None, not whole,
                                              *self._maxima(ready)])
                if sent.flags[:, 0].any():  # the batch input-dist'ed last failed on some rank
                    raise_first_failure(failure, self.group, self.ebc.world_size)
            if ready is not None:
                if self.ebc.fdo is not None and isinstance(ready.sparse_features, PrefetchedKJT):
                    ready.sparse_features.local.fdo = self.ebc.fdo.over_ranks(sent.flags[:, 4:])
                yield ready
            if sent.flags[:, 1].any() or sent.failed.any():  # this one could not be read or is invalid
                with collectives(agreeing):
                    raise_first_failure(read_error or (sent.error and self.explain(sent.error)), self.group,
                                        self.ebc.world_size)
            if sent.flags[:, 2].any():
                return
            ready, failure = batch, None
            if not sent.flags[:, 3].any():
                try:
                    with collectives("the sparse input all_to_all of a prefetched batch (its ids)"):
                        ready = dataclasses.replace(batch, sparse_features=sent.finish())
                except CollectiveError:  # a peer is gone or stalled: nothing left to agree with
                    raise
                except Exception as error:  # noqa: BLE001  carried by the next batch's lengths
                    failure = self.explain(error)

    def _maxima(self, batch: Batch | None) -> list[int]:
        """What ``batch`` carries to the other ranks for FDO (nothing without it; zeros for a
        batch whose input dist did not run ahead)."""
        if self.ebc.fdo is None:
            return []
        prepared = batch.sparse_features.local.prepared \
            if batch is not None and isinstance(batch.sparse_features, PrefetchedKJT) else None
        return self.ebc.fdo.carried(None if prepared is None else prepared.stats)
