"""Host preprocessing through the compiled extension: the outputs of ``sparsecore.preprocess``'s
numpy path, byte for byte, built on several threads with the GIL released.

The extension reads every feature's ids, lengths and weights in place (the validated
``FeatureInput`` arrays, numpy views of the KJT's tensors) and writes into arrays allocated here.
One call covers all stacks: one task per (stack, source SparseCore), and for the row-ordered
output one per (stack, destination SparseCore).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from sparsecore import native
from sparsecore.csr_format import (
    RowOrderedEntries,
    StackCSR,
    coo_buffer_size_per_device,
    partition_stats,
    raise_partition_overflow,
    row_pointers_per_sc,
)
from sparsecore.limits import StackStats
from sparsecore.stacking import StackedTable, StackingPlan
from sparsecore.validation import FeatureInput

_COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}
_NO_LIMIT = 2**62
# ids (and samples) per extra thread: below this a thread costs more to start, and on a busy host to
# get scheduled (a join can wait a time slice), than the work it takes over
WORK_PER_THREAD = 1 << 15


def default_threads(work: int) -> int:
    """The CPUs this process may run on, at most one per ``WORK_PER_THREAD`` of ``work`` (ids and
    samples to preprocess)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, work // WORK_PER_THREAD))


def preprocess_compiled(
    inputs: Mapping[str, FeatureInput], plan: StackingPlan, overflow: str, threads: int | None, row_ordered: bool
) -> dict[str, StackCSR] | dict[str, RowOrderedEntries]:
    """Every stack's CSR buffers (or, ``row_ordered``, its entries in row order) by stack name;
    raises ``native.NativeUnavailable`` when the extension cannot be built."""
    topology = plan.topology
    return preprocess_stacks_compiled(inputs, plan.stacks, topology.num_devices, topology.sparsecores_per_device,
                                      overflow, threads, row_ordered)


def preprocess_stacks_compiled(
    inputs: Mapping[str, FeatureInput], stacks: Sequence[StackedTable], devices: int, s: int, overflow: str,
    threads: int | None, row_ordered: bool,
) -> dict[str, StackCSR] | dict[str, RowOrderedEntries]:
    """:func:`preprocess_compiled` of ``stacks`` on ``devices`` x ``s`` SparseCores. Row-ordered
    under "minibatch": every entry, none dropped (the stats measure the batch as always)."""
    ext = native.require_extension()
    if overflow == "minibatch" and not row_ordered:
        raise ValueError("CSR buffers hold one pass: overflow 'minibatch' needs row_ordered=True")
    chunks = devices * s
    jobs, outputs = [], []
    for stack in stacks:
        job_outputs = _outputs(stack, inputs, chunks, s, row_ordered)
        jobs.append((feature_buffers(stack, inputs, chunks), _parameters(stack, chunks, s, row_ordered, overflow),
                     job_outputs))
        outputs.append(job_outputs)
    work = sum(x.ids.size + x.lengths.size for x in inputs.values())
    results = ext.preprocess(jobs, threads or default_threads(work))
    out = {}
    for stack, arrays, (dropped, kept) in zip(stacks, outputs, results):
        counts, unique_counts = arrays[-2:]
        if dropped and overflow == "error":
            raise_partition_overflow(stack, counts, unique_counts, stack.num_sparsecores)
        stats: StackStats = partition_stats(counts, unique_counts, devices, s, stack.num_sparsecores)
        stats.dropped_ids = int(dropped)
        if row_ordered:
            phys, sample, gain = (a[:kept] for a in arrays[:3])
            out[stack.name] = RowOrderedEntries(phys, sample, gain, stats)
        else:
            out[stack.name] = StackCSR(*arrays[:4], stats)
    return out


def feature_buffers(stack: StackedTable, inputs: Mapping[str, FeatureInput], chunks: int) -> list[tuple]:
    """Per feature in sample order: its arrays (in place when contiguous) and id transformation."""
    out = []
    for fp in sorted(stack.features, key=lambda fp: fp.sample_offset):
        x = inputs[fp.feature]
        out.append((_array(x.ids, (np.int64, np.int32)), _array(x.lengths, (np.int64, np.int32)),
                    _array(x.weights, (np.float32,)), fp.samples, fp.sample_offset // chunks, fp.col_offset,
                    fp.col_shift))
    return out


def _array(values: np.ndarray, dtypes: tuple[type, ...]) -> np.ndarray:
    if values.dtype in dtypes:
        return np.ascontiguousarray(values)
    return np.ascontiguousarray(values, dtype=dtypes[0])


def _parameters(stack: StackedTable, chunks: int, s: int, row_ordered: bool, overflow: str) -> tuple[int, ...]:
    keep_all = overflow == "minibatch"  # limits no entry reaches
    return (stack.num_sparsecores, chunks, stack.shard_rows, _NO_LIMIT if keep_all else stack.max_ids_per_partition,
            _NO_LIMIT if keep_all else stack.max_unique_ids_per_partition, coo_buffer_size_per_device(stack, s) // s,
            row_pointers_per_sc(stack), _COMBINERS[stack.combiner], int(row_ordered))


def _outputs(stack: StackedTable, inputs: Mapping[str, FeatureInput], chunks: int, s: int,
             row_ordered: bool) -> tuple[np.ndarray, ...]:
    stats = chunks * stack.num_sparsecores
    counts, unique_counts = np.empty(stats, dtype=np.int64), np.empty(stats, dtype=np.int64)
    if row_ordered:  # at most one entry per input id
        ids = sum(inputs[fp.feature].ids.size for fp in stack.features)
        return np.empty(ids, dtype=np.int64), np.empty(ids, dtype=np.int64), np.empty(ids, dtype=np.float32), \
            counts, unique_counts
    size = chunks * (coo_buffer_size_per_device(stack, s) // s)
    return (np.empty(chunks * row_pointers_per_sc(stack), dtype=np.int32), np.empty(size, dtype=np.int32),
            np.empty(size, dtype=np.int32), np.empty(size, dtype=np.float32), counts, unique_counts)
