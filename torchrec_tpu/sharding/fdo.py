"""FDO in training: each stack's partition maxima recorded at every step, merged over the ranks,
and the limits they exceeded raised at the boundaries the job chooses (checkpoints, epochs).

The counts come from the host preprocessing of each training batch (``StackStats``, measured
before any id is dropped), on the prefetch thread. With several ranks a batch's maxima ride on
the next batch's lengths all_to_all, beside the ranks' agreement flags
(:class:`~torchrec_tpu.pipeline.PrefetchedBatches`): each rank receives every rank's and takes
the MAX, so no collective of its own runs. The maxima of a batch are recorded when its training
step runs (:meth:`ShardedSparseCoreEBC.compute_and_output_dist`), so a boundary after step s has
seen steps 1..s exactly, whatever the prefetching ran ahead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from torch import nn

from sparsecore.fdo_stats import FdoStats, StackRecord
from sparsecore.limits import StackStats

if TYPE_CHECKING:
    from torchrec_tpu.sharding.ebc import LocalBatch, ShardedSparseCoreEBC

_log = logging.getLogger(__name__)


class FdoTuner:
    """The FDO records of every stack of ``ebc`` on any rank (by name; a stack on several ranks,
    a row-wise table's, takes the MAX), applied to this rank's backend, which must take new limits
    (``Backend.set_partition_limits``). ``primary`` says the limit changes in the log."""

    def __init__(self, ebc: ShardedSparseCoreEBC, primary: bool) -> None:
        self.ebc, self.primary, self.steps = ebc, primary, 0
        self.records: dict[str, StackRecord] = {}
        for rank in range(ebc.world_size):
            plan = ebc.rank_plan(rank)
            for stack in plan.stacks if plan is not None else ():
                limits = (stack.max_ids_per_partition, stack.max_unique_ids_per_partition)
                known = self.records.get(stack.name)
                if known is not None:
                    limits = (max(known.limits[0], limits[0]), max(known.limits[1], limits[1]))
                self.records[stack.name] = StackRecord(tuple(t.table for t in stack.tables), 0, 0, limits)
        self.names = sorted(self.records)  # the order of the maxima a batch carries to the other ranks
        self._mine = frozenset() if ebc.local_backend is None else {st.name for st in ebc.local_backend.plan.stacks}

    def carried(self, stats: Mapping[str, StackStats] | None) -> list[int]:
        """A batch's maxima as this rank sends them (ids, unique ids per stack of :attr:`names`;
        zeros for stacks it does not hold, or without ``stats``)."""
        stats = stats or {}
        out = []
        for name in self.names:
            s = stats.get(name)
            out += [0, 0] if s is None else [int(np.max(s.max_ids_per_partition, initial=0)),
                                             int(np.max(s.max_unique_ids_per_partition, initial=0))]
        return out

    def over_ranks(self, carried: np.ndarray) -> np.ndarray:
        """Every rank's :meth:`carried` values, ``[world, 2 x stacks]``, merged: their MAX."""
        return np.asarray(carried, np.int64).reshape(-1, 2 * len(self.names)).max(axis=0)

    def stepped(self, batch: LocalBatch) -> None:
        """A training step on ``batch`` ran: record its maxima (every rank's where they were
        merged; one rank's own). A batch whose input dist ran without the others' (not
        prefetched at several ranks) carries none and is not counted."""
        maxima = batch.fdo
        if maxima is None and self.ebc.world_size == 1 and batch.prepared is not None:
            maxima = np.asarray(self.carried(batch.prepared.stats))
        if maxima is None:
            return
        self.steps += 1
        for i, name in enumerate(self.names):
            self.records[name] = self.records[name].observed(int(maxima[2 * i]), int(maxima[2 * i + 1]))

    def tune(self) -> list[str]:
        """Raise every exceeded stack's limits to what it saw (this rank's backend takes its own
        stacks'); one line per stack changed, logged by the primary."""
        lines, mine = [], {}
        for name, record in self.records.items():
            if not record.exceeded:
                continue
            raised = record.raised()
            changes = [f"{what} {old} -> {new}" for what, old, new in zip(
                ("max_ids_per_partition", "max_unique_ids_per_partition"), record.limits, raised.limits) if new != old]
            lines.append(f"FDO: stack {name} ({len(record.tables)} table(s)): {', '.join(changes)} "
                         f"(the most one partition got in {self.steps} steps)")
            self.records[name] = raised
            if name in self._mine:
                mine[name] = raised.limits
        if mine:
            self.ebc.local_backend.set_partition_limits(mine)  # type: ignore[union-attr]
        if self.primary:
            for line in lines:
                _log.info(line)
        return lines

    def stats(self) -> FdoStats:
        return FdoStats(self.steps, dict(self.records))

    def load(self, stats: FdoStats) -> None:
        """Continue from ``stats`` (a checkpoint's): its steps, maxima and limits (never below this
        job's own), applied to this rank's backend. Records of stacks this job lacks are kept as
        they are (written back with the others)."""
        self.steps = stats.steps
        mine = {}
        for name, saved in stats.stacks.items():
            record = self.records.get(name)
            if record is not None:
                saved = StackRecord(record.tables, saved.max_ids, saved.max_unique_ids,
                                    (max(saved.limits[0], record.limits[0]), max(saved.limits[1], record.limits[1])))
                if name in self._mine:
                    mine[name] = saved.limits
            self.records[name] = saved
        if mine:
            self.ebc.local_backend.set_partition_limits(mine)  # type: ignore[union-attr]


def tuner_of(model: nn.Module) -> FdoTuner | None:
    """The FDO tuner of ``model``'s sharded EBC (None: it records none)."""
    from torchrec_tpu.sharding.ebc import ShardedSparseCoreEBC

    return next((m.fdo for m in model.modules() if isinstance(m, ShardedSparseCoreEBC) and m.fdo is not None), None)



def tuned_stats(model: nn.Module) -> FdoStats | None:
    """At a boundary (a checkpoint): the exceeded limits of ``model``'s FDO raised, then its stats
    (None: it records none)."""
    tuner = tuner_of(model)
    if tuner is None:
        return None
    tuner.tune()
    return tuner.stats()


def resume_fdo(model: nn.Module, meta: Mapping[str, object], checkpoint: str) -> None:
    """``model``'s FDO continued from a checkpoint's ``meta`` (nothing without FDO, or when the
    checkpoint recorded none)."""
    tuner = tuner_of(model)
    if tuner is not None and "fdo" in meta:
        tuner.load(FdoStats.from_json(meta["fdo"], f"checkpoint {checkpoint}: meta.json's \"fdo\""))
