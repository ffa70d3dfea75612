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
from torchrec_tpu.rank_agreement import fail_together
from torchrec_tpu.rank_watch import collectives
from torchrec_tpu.sharding import ShardedSparseCoreEBC


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
        never input-dist'ed."""
        return prefetched(self._prepared(row), self.depth, lockstep=self.group is not None)

    def _prepared(self, row: int) -> Iterator[Batch]:
        """Runs on the prefetch thread: read, move to the device, input dist. With several ranks,
        they agree that each one's input dist went well before any of them trains on the batch:
        it can fail on one rank only after the all_to_alls (a SparseCore partition over its limit),
        which then fails every rank at once instead of leaving them in the step's collectives."""
        for batch in batches_from_row(self.batches, row):
            batch = batch.to(self.device)
            if batch.sparse_features.stride() == self.ebc.padded_local_batch:
                batch = self._input_dist(batch)
            yield batch

    def _input_dist(self, batch: Batch) -> Batch:
        several = self.ebc.world_size > 1
        failure = None
        try:
            with collectives("the sparse input all_to_all of a prefetched batch"):
                kjt = self.ebc.prefetch(batch.sparse_features, self.group)
        except CollectiveError:  # a peer is gone or stalled: nothing left to agree with
            raise
        except Exception as error:
            failure = self.explain(error)
            if not several:
                raise failure from error
        if several:  # raises on every rank when any rank's input dist failed
            fail_together(failure, self.group, self.ebc.world_size, "the check after a sparse input dist")
        return dataclasses.replace(batch, sparse_features=kjt)
