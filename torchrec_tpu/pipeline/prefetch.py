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
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from pipelines.streams import batches_from_row, prefetched
from torchrec_tpu.sharding import ShardedSparseCoreEBC
from torchrec_tpu.train.rank_watch import collectives


class PrefetchedBatches:
    """Re-iterable like ``batches`` (and as long); each pass runs its own prefetch thread.

    ``group``: the process group the prefetch thread's input dists use; with more than one rank
    it must be a group of its own (``dist.new_group()``), so they never interleave with the
    step's output-dist collectives on the default group.
    """

    def __init__(self, batches: Iterable[Batch], ebc: ShardedSparseCoreEBC, device: torch.device,
                 depth: int = 2, group: dist.ProcessGroup | None = None):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        if ebc.world_size > 1 and group is None:
            raise ValueError("with several ranks the prefetch thread needs its own process group (dist.new_group())")
        self.batches, self.ebc, self.device, self.depth, self.group = batches, ebc, device, depth, group

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from_row(0)

    def iter_from_row(self, row: int) -> Iterator[Batch]:
        """The batches from row ``row`` on (seeking the loader when it can); the rows before are
        never input-dist'ed."""
        return prefetched(self._prepared(row), self.depth)

    def _prepared(self, row: int) -> Iterator[Batch]:
        """Runs on the prefetch thread: read, move to the device, input dist."""
        for batch in batches_from_row(self.batches, row):
            batch = batch.to(self.device)
            if batch.sparse_features.stride() == self.ebc.batch_size:
                with collectives("the sparse input all_to_all of a prefetched batch"):
                    batch = dataclasses.replace(batch, sparse_features=self.ebc.prefetch(batch.sparse_features,
                                                                                         self.group))
            yield batch
