"""``infer`` as several ranks under torchrun: who scores which parts, and the ranks in step.

Rank 0 finds the parts still to write and claims the output directory; every rank then scores
the parts ``i`` with ``i % world == rank`` of that list (whole input row groups), writing each
as one rank's run would: the output directory is the same whatever the world (the same part
files, row ids and ``_inputs.json`` manifest). The sharded tables' lookup is a collective, so
every rank runs as many forwards as the rank with the most (the others run empty, zero-padded
batches at the end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch.distributed as dist

from torchrec_tpu.inference.units import Unit

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the job's ranks (a process group is joined)."""

    rank: int
    world: int

    @classmethod
    def of_group(cls) -> Ranks:
        return cls(dist.get_rank(), dist.get_world_size())

    def share(self, todo: Sequence[Unit]) -> list[Unit]:
        """The units of ``todo`` this rank scores."""
        return list(todo[self.rank::self.world])

    def forwards(self, todo: Sequence[Unit], batch_size: int) -> int:
        """Forwards every rank runs: the most any rank's share needs at ``batch_size`` rows each."""
        return max(sum(math.ceil(u.num_rows / batch_size) for u in todo[r::self.world]) for r in range(self.world))

    def from_first(self, make: Callable[[], T]) -> T:
        """``make()`` run on rank 0, its value (or its error, raised again) on every rank."""
        sent: list[object] = [None]
        if self.rank == 0:
            try:
                sent[0] = (make(), None)
            except Exception as error:  # noqa: BLE001  raised on every rank below
                sent[0] = (None, error)
        dist.broadcast_object_list(sent, src=0)
        value, error = sent[0]  # type: ignore[misc]
        if error is not None:
            raise error
        return value

    def gathered(self, value: T) -> list[T]:
        """Every rank's ``value``, by rank (a collective: every rank has finished what came before)."""
        values: list[object] = [None] * self.world
        dist.all_gather_object(values, value)
        return values  # type: ignore[return-value]
