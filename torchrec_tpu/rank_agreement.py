"""Ranks agree, batch by batch, that every one of them has its next batch before any collective
runs on it: a rank whose reader fails (a bad value, an unreadable file) makes every rank fail at
once with the same message, and a rank that runs out of batches first (rows skipped under
``--bad-values``) ends the pass on every rank, instead of leaving the others waiting in a
collective until the timeout. Evaluation, which must see every row, passes an ``exhausted``
batch instead: a rank out of batches yields it until every rank is out.

:class:`AgreedBatches` costs one all_reduce of two int64s per batch over the group the batches are
consumed on. The sparsecore engine's training batches agree without one: their flags ride on each
batch's lengths all_to_all (:class:`~torchrec_tpu.pipeline.PrefetchedBatches`), which also carries
whether the previous batch's input dist went well on every rank (it can fail on one rank after its
collectives: a SparseCore partition over its id limit); :func:`raise_first_failure` then fails
every rank with one message.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from pipelines.streams import BatchStream, batches_from_row
from torchrec_tpu.errors import CollectiveError, is_user_error, one_line
from torchrec_tpu.rank_watch import collectives


class RankFailure(CollectiveError):
    """Raised on every rank when one rank's batch failed; the same message everywhere."""


class AgreedBatches(BatchStream):
    """Re-iterable like ``batches`` (``len`` and ``iter_from_row`` included), agreed over
    ``group`` as the module docstring says. Every rank must iterate it in step. Without
    ``exhausted`` the pass ends on every rank when one rank runs out; with it, a rank out of
    batches yields ``exhausted`` while another rank still has a batch."""

    def __init__(self, batches: Iterable[Batch], group: dist.ProcessGroup | None, rank: int, world_size: int,
                 what: str = "batch", exhausted: Batch | None = None) -> None:
        self.batches, self.group, self.rank, self.world_size, self.what = batches, group, rank, world_size, what
        self.exhausted = exhausted

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from_row(0)

    def iter_from_row(self, row: int) -> Iterator[Batch]:
        return self._agreed(iter(batches_from_row(self.batches, row)))

    def _agreed(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        index = 0
        while True:
            batch, failure = None, None
            try:
                batch = next(batches)
            except StopIteration:
                pass
            except Exception as error:  # noqa: BLE001  agreed on below, raised on every rank
                failure = error
            flags = torch.tensor([failure is not None, batch is None], dtype=torch.int64)
            with collectives(f"the agreement before {self.what} {index} (an all_reduce)"):
                dist.all_reduce(flags, group=self.group)
                if flags[0]:
                    raise_first_failure(failure, self.group, self.world_size)
            if flags[1] == self.world_size or (flags[1] and self.exhausted is None):
                return
            yield self.exhausted if batch is None else batch
            index += 1


def raise_first_failure(failure: BaseException | None, group: dist.ProcessGroup | None, world_size: int) -> None:
    """Every rank calls this once any rank failed (``failure``: this rank's error, or None): each
    raises :class:`RankFailure` naming the first failed rank's error (a collective)."""
    message = None
    if failure is not None:
        text = one_line(failure)
        message = text if is_user_error(failure) else f"internal error ({type(failure).__name__}): {text}"
    gathered: list[str | None] = [None] * world_size
    dist.all_gather_object(gathered, message, group=group)
    first = next(r for r, m in enumerate(gathered) if m is not None)
    raise RankFailure(f"rank {first}: {gathered[first]}") from failure
