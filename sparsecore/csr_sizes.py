"""Each batch's CSR buffers cut to the sizes it needs, and its touched rows found on the host: what
the ``ops`` backend feeds the ``tpu::`` SparseCore ops (:mod:`sparsecore.csr_math` off TPU), here
below the backends so that any driver of that math cuts the buffers alike.

Preprocessing lays a stack's buffers out for its configured ids-per-partition limit. A batch's
largest partition usually needs far less: :func:`fit_csr` cuts the buffers to a bucket of that
partition (:func:`csr_bucket`: the ``partition`` bucket of the core's padding policy,
``sparsecore.entries.Buckets``; by default eight sizes per power of two, at most 12.5% padding), so the
programs run over the real entries plus little padding and only a few buffer sizes, hence
programs, occur; :func:`csr_limits` reads that bucket back from the buffers' size.
:class:`CsrFitter` also deduplicates each stack's touched rows on the host
(``csr_math.touched_rows``, ahead of the step) cut to a bucket of their count, and never shrinks a
stack's sizes, or batches whose counts straddle a bucket boundary would alternate between two
programs. Where a batch needs more than a stack's sizes hold, they grow with :func:`headroom`
past that batch's need: every new size compiles the step program again (seconds on XLA:CPU), and
sizes fitted tightly to the first batches would grow again each time a later batch's count lands
a little higher, well into the run.

Under the "minibatch" overflow policy (:meth:`CsrFitter.minibatched`) a stack whose batch is over
its limits gets jax-tpu-embedding's minibatches instead (``sparsecore.minibatching.op_buffers``:
k passes that fit, laid out as :func:`~sparsecore.minibatching.pass_bucket` of k slots, so a
program sees at most 7 shapes of a stack, ever); the ops read the slots back from the buffers'
size (:func:`csr_minibatches`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from sparsecore import csr_math
from sparsecore.csr_format import StackCSR, round_up_array, row_pointers_per_sc
from sparsecore.entries import DEFAULT_BUCKETS, Buckets
from sparsecore.limits import StackStats
from sparsecore.minibatching import minibatch_entries, op_buffers, pass_bucket
from sparsecore.preprocess import PreprocessedBatch, preprocess_inputs
from sparsecore.stacking import StackedTable, StackingPlan
from sparsecore.validation import FeatureInput
from tpu_facts import ALIGNMENT, round_up

CSR_FIELDS = ("row_pointers", "embedding_ids", "sample_ids", "gains")
Agree = Callable[[list[int]], list[int]]  # this rank's buffer sizes -> the sizes every rank uses


def bucket_limit(needed: int, limit: int, buckets: Buckets = DEFAULT_BUCKETS) -> int:
    """The ids-per-partition limit a batch whose largest partition holds ``needed`` ids is laid
    out for: ``needed`` rounded up to its ``partition`` bucket (by default one of eight sizes per
    power of two: at most 12.5% padding) and to a multiple of 8, at least 8; the configured
    ``limit`` itself where that is not smaller."""
    bucket = round_up(max(buckets.partition(int(needed)), ALIGNMENT), ALIGNMENT)
    return bucket if bucket < limit else limit


def headroom(count: int) -> int:
    """The margin a size that has to grow for ``count`` (ids in a partition, unique rows) grows by,
    so that later batches of the same stream fit in all but rare cases: four standard deviations
    of a Poisson count of that mean (a partition's ids are many independent draws), and at least
    1/16 of it (distinct rows spread wider: MLPerf's multi-hot batches' vary by about 2%)."""
    return max(math.ceil(4 * math.sqrt(count)), count // 16)


def grown(size: int, count: int, bucket: Callable[[int], int]) -> int:
    """``size`` where ``count``'s ``bucket`` fits in it, else the bucket of ``count`` plus its
    :func:`headroom` (what a stack's size becomes after a batch that needs ``count``)."""
    return size if bucket(count) <= size else bucket(count + headroom(count))


def largest_partition(stack: StackedTable, chunks: int, row_pointers: np.ndarray) -> int:
    """The ids the largest partition of ``stack``'s CSR buffers (of ``chunks`` source
    SparseCores; ``row_pointers``) holds."""
    n = stack.num_sparsecores
    ends = row_pointers.reshape(chunks, row_pointers_per_sc(stack))[:, :n].astype(np.int64)
    starts = np.zeros_like(ends)
    starts[:, 1:] = round_up_array(ends[:, :-1], ALIGNMENT)
    return int((ends - starts).max(initial=0))


def csr_bucket(stack: StackedTable, chunks: int, row_pointers: np.ndarray, buckets: Buckets = DEFAULT_BUCKETS) -> int:
    """The ids-per-partition limit :func:`fit_csr` lays ``stack``'s buffers out for: the
    :func:`bucket_limit` of their :func:`largest_partition`."""
    return bucket_limit(largest_partition(stack, chunks, row_pointers), stack.max_ids_per_partition, buckets)


def fit_csr(stack: StackedTable, chunks: int, row_pointers: np.ndarray, *buffers: np.ndarray,
            limit: int | None = None) -> tuple[np.ndarray, ...]:
    """``stack``'s CSR buffers (of ``chunks`` source SparseCores, laid out for its configured
    limit) laid out for ``limit`` (default :func:`csr_bucket`; at least that) instead: each
    source region keeps its first ``limit * N`` positions, which hold all its entries (partitions
    padded to 8 each hold at most the bucket). Byte for byte the buffers preprocessing with that
    limit builds; the row pointers do not change."""
    n = stack.num_sparsecores
    limit = csr_bucket(stack, chunks, row_pointers) if limit is None else limit
    if limit == stack.max_ids_per_partition:
        return (row_pointers, *buffers)
    return (row_pointers, *(b.reshape(chunks, -1)[:, :limit * n].reshape(-1) for b in buffers))


def csr_limits(stack: StackedTable, chunks: int, embedding_ids) -> tuple[int, int]:
    """(max ids, max unique ids) per partition of ``stack``'s CSR buffers from their size (see
    :func:`fit_csr`; ``embedding_ids``: any array): the configured limits for full-size buffers,
    else the bucket."""
    limit = min(stack.max_ids_per_partition, embedding_ids.shape[0] // (chunks * stack.num_sparsecores))
    if limit == stack.max_ids_per_partition:
        return limit, stack.max_unique_ids_per_partition
    return limit, min(limit, stack.max_unique_ids_per_partition)


def csr_minibatches(stack: StackedTable, chunks: int, row_pointers) -> int:
    """The minibatch slots of ``stack``'s buffers (of ``chunks`` source SparseCores; 1: one pass),
    the ops' ``num_minibatches``, from the row pointers' size (``row_pointers``: any array)."""
    return row_pointers.shape[0] // (chunks * row_pointers_per_sc(stack))


class CsrFitter:
    """Cuts the batches of one ``plan`` (its stacks on ``plan.topology``'s SparseCores) to their
    ``buckets`` (partitions' ids, touched rows), which only grow (with :func:`headroom`); ``agree``
    (where given) maps this rank's sizes to those every rank uses (their maximum: ranks running
    one SPMD program need buffers of one size)."""

    def __init__(self, plan: StackingPlan, buckets: Buckets = DEFAULT_BUCKETS) -> None:
        self.plan = plan
        self.buckets = buckets
        self.chunks = plan.topology.num_sparsecores
        self._limit_floor = [0] * len(plan.stacks)
        self._unique_floor = [0] * len(plan.stacks)

    def cut(self, batch: PreprocessedBatch, agree: Agree | None = None) -> list[tuple[np.ndarray, ...]]:
        """Per stack in plan order, its four CSR buffers (:data:`CSR_FIELDS`) cut to the batch's
        bucket (contiguous)."""
        return self._cut(batch.stacks, agree)

    def _cut(self, stacks_csr: Mapping[str, StackCSR], agree: Agree | None) -> list[tuple[np.ndarray, ...] | None]:
        """:meth:`cut` of the stacks in ``stacks_csr``; None for the others, whose size stays
        their configured limit (minibatched)."""
        stacks = self.plan.stacks
        full = [[getattr(stacks_csr[st.name], f) for f in CSR_FIELDS] if st.name in stacks_csr else None
                for st in stacks]
        limits = [st.max_ids_per_partition if buffers is None else
                  grown(floor, largest_partition(st, self.chunks, buffers[0]),
                        lambda n, st=st: bucket_limit(n, st.max_ids_per_partition, self.buckets))
                  for st, buffers, floor in zip(stacks, full, self._limit_floor)]
        if agree is not None:
            limits = agree(limits)
        self._limit_floor = limits
        return [None if buffers is None else
                tuple(np.ascontiguousarray(a) for a in fit_csr(st, self.chunks, *buffers, limit=limit))
                for st, buffers, limit in zip(stacks, full, limits)]

    def minibatched(self, inputs: Mapping[str, FeatureInput], agree: Agree | None = None,
                    ) -> tuple[list[tuple[np.ndarray, ...]], dict[str, StackStats]]:
        """Per stack in plan order, its four buffers under the "minibatch" policy, and the batch's
        stats: a stack over its limits as minibatches (in :func:`pass_bucket` slots; with
        ``agree``, the most of any rank, so that the ranks' buffers keep one shape), every other
        as :meth:`cut`. 0 ids dropped; a batch no split fits raises PartitionOverflowError."""
        topology = self.plan.topology
        # one pass of every stack (the compiled engine; its stats are measured before any drop):
        # the stacks it dropped ids of are over their limits, and only those are split
        one_pass = preprocess_inputs(inputs, self.plan, overflow="drop").stacks
        entries = {name: minibatch_entries(self.plan.stack(name), inputs, topology.num_devices,
                                           topology.sparsecores_per_device)
                   for name, csr in one_pass.items() if csr.stats.dropped_ids}
        slots = [pass_bucket(entries[st.name].num_minibatches) if st.name in entries else 1 for st in self.plan.stacks]
        if agree is not None:
            slots = agree(slots)
        split = {}
        for st, k in zip(self.plan.stacks, slots):
            if k > 1:
                if st.name not in entries:  # (fits here, split on another rank)
                    entries[st.name] = minibatch_entries(st, inputs, topology.num_devices,
                                                         topology.sparsecores_per_device)
                split[st.name] = op_buffers(st, entries[st.name], topology.num_devices,
                                            topology.sparsecores_per_device, k)
        cut = self._cut({name: csr for name, csr in one_pass.items() if name not in split}, agree)
        buffers = [tuple(getattr(split[st.name], f) for f in CSR_FIELDS) if c is None else c
                   for st, c in zip(self.plan.stacks, cut)]
        stats = {st.name: entries[st.name].stats if st.name in entries else one_pass[st.name].stats
                 for st in self.plan.stacks}
        return buffers, stats

    def touched(self, csr: Sequence[tuple[np.ndarray, ...]], agree: Agree | None = None) -> list[np.ndarray]:
        """Per stack, the fused update's deduplication of its cut buffers ``csr`` (a
        ``csr_math.touched_rows`` vector, its unique rows cut to a bucket of their count)."""
        touched, entries = [], []
        for st, buffers in zip(self.plan.stacks, csr):
            phys = csr_math.decode(*buffers, st.vocab_size, st.total_sample_count, xp=np,
                                   minibatches=csr_minibatches(st, self.chunks, buffers[0]))[0]
            touched.append(csr_math.touched_rows(phys, st.vocab_size, xp=np))
            entries.append(buffers[1].shape[0])
        unique = [min(e, grown(floor, csr_math.touched_count(t, e),
                               lambda n, e=e: csr_math.unique_bucket(n, e, self.buckets)))
                  for t, e, floor in zip(touched, entries, self._unique_floor)]
        if agree is not None:
            unique = agree(unique)
        self._unique_floor = unique
        return [csr_math.fit_touched(t, e, u) for t, e, u in zip(touched, entries, unique)]
