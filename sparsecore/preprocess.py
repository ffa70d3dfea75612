"""Host preprocessing: sparse ids -> per-SparseCore CSR-wrapped COO buffers.

Two engines build the same bytes: the compiled extension (``sparsecore.preprocess_native``,
multi-threaded C++, the default wherever it builds) and the vectorized numpy code in this module,
the reference it is tested against and the fallback.

The output is jax-tpu-embedding's device input format, per stacked table:

- the batch of every feature is split into ``devices x SCs per device`` contiguous chunks; chunk
  k is served by local SparseCore ``k % S`` of device ``k // S``; features of one stack are
  concatenated inside each chunk (``sample_ids`` are chunk-local);
- id i goes to destination SparseCore ``p = (i % N + rotation) % N`` at shard row
  ``i // N + row_offset_in_shard`` (``embedding_ids``);
- one source SparseCore's region holds its N partitions in order, sorted by (row, sample),
  the same (row, sample) merged with gains summed, each partition padded to a multiple of 8
  with id 2^31-1 and gain NaN; ``row_pointers`` holds each partition's end, then the region's
  rounded end repeated up to max(N, 8) entries; the rest of the region is padding too (where
  jax-tpu-embedding leaves it uninitialised), so outputs are deterministic;
- combiners are folded into the gains (sum: w, mean: w / sum w, sqrtn: w / sqrt(sum w^2)),
  rounded exactly as jax-tpu-embedding's C++ rounds them;
- the buffers have the static size jax-tpu-embedding gives them: every partition at its limit.

Tested byte for byte against jax-tpu-embedding 0.1.0 on randomized inputs (tests/sparsecore).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import sparsecore.native as native
from sparsecore.csr_format import (
    RowOrderedEntries,
    StackCSR,
    lay_out_csr,
    partition_stats,
    raise_partition_overflow,
)
from sparsecore.input_checks import check_id_range
from sparsecore.limits import ONE_PASS_POLICIES, StackStats, check_overflow_policy
from sparsecore.minibatching import check_split_fits
from sparsecore.stacking import StackedTable, StackingPlan
from sparsecore.validation import FeatureInput, feature_inputs
from tpu_facts import PADDING_ID  # noqa: F401  (the padding id callers read here)

ENGINES = ("auto", "compiled", "numpy")  # auto: compiled when the extension builds, else numpy


@dataclass(frozen=True)
class PreprocessedBatch:
    stacks: dict[str, StackCSR]

    @property
    def stats(self) -> dict[str, StackStats]:
        return {name: csr.stats for name, csr in self.stacks.items()}


def preprocess(
    kjt: KeyedJaggedTensor,
    plan: StackingPlan,
    *,
    overflow: str = "error",
    id_policy: str = "error",
    engine: str = "auto",
) -> PreprocessedBatch:
    """Validate a KJT and build the CSR buffers of every stack (see module docstring)."""
    inputs = feature_inputs(kjt, plan.features, plan.tables, id_policy)
    return preprocess_inputs(inputs, plan, overflow=overflow, engine=engine)


def preprocess_inputs(
    inputs: Mapping[str, FeatureInput], plan: StackingPlan, *, overflow: str = "error", threads: int | None = None,
    engine: str = "auto",
) -> PreprocessedBatch:
    """Build the CSR buffers from already validated per-feature inputs on ``threads`` threads
    (default: the CPUs; numpy: one per stack, its sorts release the GIL). Ids outside their
    table's rows raise (:func:`check_table_ids`). One pass: ``overflow`` is "error" or "drop"
    (``sparsecore.minibatching`` builds the passes of "minibatch")."""
    check_overflow_policy(overflow, ONE_PASS_POLICIES, "one pass of CSR buffers (preprocess_inputs)")
    compiled = use_compiled(engine, overflow)
    check_table_ids(inputs, plan)
    if compiled:
        from sparsecore.preprocess_native import preprocess_compiled

        return PreprocessedBatch(preprocess_compiled(inputs, plan, overflow, threads, row_ordered=False))
    devices, s = plan.topology.num_devices, plan.topology.sparsecores_per_device
    threads = threads or min(len(plan.stacks), os.cpu_count() or 1)

    def build(stack: StackedTable) -> StackCSR:
        return _preprocess_stack(stack, inputs, devices, s, overflow)

    if threads <= 1:
        return PreprocessedBatch({stack.name: build(stack) for stack in plan.stacks})
    with ThreadPoolExecutor(threads) as pool:
        return PreprocessedBatch(dict(zip((st.name for st in plan.stacks), pool.map(build, plan.stacks))))


def preprocess_row_ordered(
    inputs: Mapping[str, FeatureInput], plan: StackingPlan, *, overflow: str = "error", threads: int | None = None,
    engine: str = "auto",
) -> dict[str, RowOrderedEntries]:
    """The entries ``preprocess_inputs`` would lay out into CSR buffers, per stack, in row order
    (numpy: one sort; the CSR buffers are only built when a partition is over its limit). Under
    "minibatch" every entry is kept: the sum of the minibatches' passes is the one pass over all
    of them; a batch over a limit is only checked to split into minibatches that fit
    (``sparsecore.minibatching.check_split_fits``), which the xla programs need not run."""
    compiled = use_compiled(engine, overflow)
    check_table_ids(inputs, plan)
    devices, s = plan.topology.num_devices, plan.topology.sparsecores_per_device
    if not compiled:
        return {stack.name: _row_ordered_stack(stack, inputs, devices, s, overflow) for stack in plan.stacks}
    from sparsecore.preprocess_native import preprocess_compiled

    by_stack = preprocess_compiled(inputs, plan, overflow, threads, row_ordered=True)
    if overflow == "minibatch":
        for stack in plan.stacks:
            if _over_limits(stack, by_stack[stack.name].stats):
                check_split_fits(stack, by_stack[stack.name], devices * s)
    return by_stack


def check_table_ids(inputs: Mapping[str, FeatureInput], plan: StackingPlan) -> None:
    """ValueError naming the feature, the id and the table's rows when an id of ``inputs`` lies
    outside its table in ``plan``: both engines would place it in another table's rows of the
    stack, or wrap it in the int32 buffers."""
    for stack in plan.stacks:
        rows = {t.table: t.vocab_size for t in stack.tables}
        for fp in stack.features:
            if fp.feature not in inputs:
                raise ValueError(f"no input for feature {fp.feature!r} of stack {stack.name!r}; inputs have "
                                 f"{sorted(inputs)}")
            ids = inputs[fp.feature].ids
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= rows[fp.table]):
                check_id_range(ids, rows[fp.table], f"feature {fp.feature!r} (table {fp.table!r})")


def use_compiled(engine: str, overflow: str) -> bool:
    """Whether ``engine`` (of :data:`ENGINES`) means the compiled path (checks both arguments)."""
    check_overflow_policy(overflow)
    if engine not in ENGINES:
        raise ValueError(f"preprocessing engine must be one of {ENGINES}, got {engine!r}")
    if engine == "compiled":
        native.require_extension()
        return True
    return engine == "auto" and native.extension() is not None


def _row_ordered_stack(
    stack: StackedTable, inputs: Mapping[str, FeatureInput], devices: int, s: int, overflow: str
) -> RowOrderedEntries:
    n, chunks = stack.num_sparsecores, devices * s
    samples_per_chunk = stack.total_sample_count // chunks
    chunk, dest, row, sample, gain = coo_entries(stack, inputs, chunks)
    phys = dest * stack.shard_rows + row
    order, first = _merge_order((sample, chunk, phys), (samples_per_chunk, chunks, stack.vocab_size))
    starts = np.flatnonzero(first)
    multiplicity = np.diff(np.append(starts, phys.size))
    merged_gain = _sequential_f32_sum(gain[order].astype(np.float64), starts, multiplicity)
    picked = order[starts]
    phys, chunk, dest, sample = phys[picked], chunk[picked], dest[picked], sample[picked]
    partition = chunk * n + dest
    counts = np.bincount(partition, minlength=chunks * n)
    new_row = np.ones(phys.size, dtype=bool)
    new_row[1:] = (phys[1:] != phys[:-1]) | (chunk[1:] != chunk[:-1])
    unique_counts = np.bincount(partition[new_row], minlength=chunks * n)
    entries = RowOrderedEntries(phys, chunk * samples_per_chunk + sample, merged_gain,
                                partition_stats(counts, unique_counts, devices, s, n))
    over = _over_limits(stack, entries.stats)
    if over and overflow == "minibatch":
        check_split_fits(stack, entries, chunks)
    elif over:
        from sparsecore.csr_math import row_ordered

        # raises, or drops as the SparseCores do
        return row_ordered(_preprocess_stack(stack, inputs, devices, s, overflow), stack.vocab_size,
                           stack.total_sample_count)
    return entries


def _over_limits(stack: StackedTable, stats: StackStats) -> bool:
    """Whether a batch of ``stats`` has a partition over one of ``stack``'s limits."""
    return int(stats.max_ids_per_partition.max(initial=0)) > stack.max_ids_per_partition or \
        int(stats.max_unique_ids_per_partition.max(initial=0)) > stack.max_unique_ids_per_partition


def _preprocess_stack(
    stack: StackedTable, inputs: Mapping[str, FeatureInput], devices: int, s: int, overflow: str
) -> StackCSR:
    n = stack.num_sparsecores
    chunks = devices * s
    samples_per_chunk = stack.total_sample_count // chunks
    chunk, dest, row, sample, gain = coo_entries(stack, inputs, chunks)
    chunk, dest, row, sample, gain, multiplicity = sort_and_merge(
        chunk, dest, row, sample, gain, n, stack.shard_rows, samples_per_chunk)

    partition = chunk * n + dest
    num_partitions = chunks * n
    counts = np.bincount(partition, minlength=num_partitions)
    first_of_partition = np.repeat(np.cumsum(counts) - counts, counts)  # entries are sorted by partition
    rank = np.arange(partition.size) - first_of_partition
    new_row = np.ones(partition.size, dtype=bool)
    new_row[1:] = (partition[1:] != partition[:-1]) | (row[1:] != row[:-1])
    unique_before = np.cumsum(new_row) - 1
    unique_rank = unique_before - unique_before[first_of_partition]

    unique_counts = np.bincount(partition[new_row], minlength=num_partitions)
    stats = partition_stats(counts, unique_counts, devices, s, n)
    keep = (rank < stack.max_ids_per_partition) & (unique_rank < stack.max_unique_ids_per_partition)
    if not keep.all():
        if overflow == "error":
            raise_partition_overflow(stack, counts, unique_counts, n)
        stats.dropped_ids = int(multiplicity[~keep].sum())  # input ids, counted before merging
        partition, row, sample, gain, rank = (a[keep] for a in (partition, row, sample, gain, rank))
        counts = np.bincount(partition, minlength=num_partitions)

    return lay_out_csr(stack, devices, s, partition, row, sample, gain, rank, stats)


def coo_entries(stack: StackedTable, inputs: Mapping[str, FeatureInput], chunks: int):
    """Per id of every feature of the stack: (chunk, destination SC, shard row, sample, gain)."""
    n = stack.num_sparsecores
    xs = [inputs[fp.feature] for fp in stack.features]
    ids = np.concatenate([x.ids for x in xs])
    lengths = np.concatenate([x.lengths for x in xs])
    chunk_of, local_of, col_offset_of, col_shift_of = _sample_layout(stack, chunks)
    sample = np.repeat(np.arange(lengths.size), lengths)  # in the stack's concatenated batch
    gain = combined_gains(np.concatenate([x.weights for x in xs]), lengths, sample, stack.combiner)
    return chunk_of[sample], (ids % n + col_shift_of[sample]) % n, (ids + col_offset_of[sample]) // n, \
        local_of[sample], gain


_LAYOUTS: dict[tuple[int, int], tuple[StackedTable, tuple[np.ndarray, ...]]] = {}


def _sample_layout(stack: StackedTable, chunks: int) -> tuple[np.ndarray, ...]:
    """Per sample of the stack's concatenated batch: its chunk, its chunk-local sample id and its
    feature's column offset and shift (cached by identity: hashing a stack costs more than this)."""
    cached = _LAYOUTS.get((id(stack), chunks))
    if cached is None or cached[0] is not stack:
        cached = _LAYOUTS[(id(stack), chunks)] = (stack, _compute_sample_layout(stack, chunks))
    return cached[1]


def _compute_sample_layout(stack: StackedTable, chunks: int) -> tuple[np.ndarray, ...]:
    parts = []
    for fp in stack.features:
        per_chunk = fp.samples // chunks
        i = np.arange(fp.samples, dtype=np.int64)
        parts.append((i // per_chunk, i % per_chunk + fp.sample_offset // chunks,
                      np.full(fp.samples, fp.col_offset, dtype=np.int64),
                      np.full(fp.samples, fp.col_shift, dtype=np.int64)))
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(4))


def combined_gains(weights: np.ndarray, lengths: np.ndarray, sample: np.ndarray, combiner: str) -> np.ndarray:
    """Fold the combiner into per-id gains, rounding like jax-tpu-embedding's C++ (float32
    running sums in id order; sqrtn accumulates w^2 with fused multiply-add)."""
    if combiner == "sum":
        return weights.astype(np.float32, copy=True)
    w64 = weights.astype(np.float64)
    offsets = np.cumsum(lengths) - lengths
    total = _sequential_f32_sum(w64 * w64 if combiner == "sqrtn" else w64, offsets, lengths)
    if combiner == "sqrtn":
        total = np.sqrt(total)
    return (weights / total[sample]).astype(np.float32)


def _sequential_f32_sum(values: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Float32 left-to-right sum of each segment ``values[offset:offset+length]``.

    ``values`` are float64 holding exact float32 values or products of two (w^2), so each step
    rounds once to float32, like a float32 add (or fma). Vectorized over segments: one numpy
    step per position over the segments still that long.
    """
    total = np.zeros(lengths.size, dtype=np.float32)
    active = np.flatnonzero(lengths > 0)
    total[active] = values[offsets[active]]
    j = 1
    while True:
        active = active[lengths[active] > j]
        if active.size == 0:
            return total
        total[active] = (total[active].astype(np.float64) + values[offsets[active] + j]).astype(np.float32)
        j += 1


def sort_and_merge(chunk, dest, row, sample, gain, n, shard_rows, samples_per_chunk):
    """Sort by (chunk, dest, row, sample) and merge equal keys, summing their gains; also
    returns how many input ids each merged entry stands for."""
    if chunk.size == 0:
        return chunk, dest, row, sample, gain, np.zeros(0, dtype=np.int64)
    order, first = _merge_order((sample, row, dest, chunk), (samples_per_chunk, shard_rows, n, int(chunk.max()) + 1))
    starts = np.flatnonzero(first)
    multiplicity = np.diff(np.append(starts, chunk.size))
    merged_gain = _sequential_f32_sum(gain[order].astype(np.float64), starts, multiplicity)
    picked = order[starts]
    return chunk[picked], dest[picked], row[picked], sample[picked], merged_gain, multiplicity


def _merge_order(keys: tuple[np.ndarray, ...], bounds: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The order sorting by ``keys`` (last = most significant, each below its bound), input order
    among equal keys (it fixes the float32 summation order of merged gains), and whether each
    sorted entry starts a new key."""
    size = keys[0].size
    if size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    if int(np.prod([float(b) for b in bounds])) * size < 2**62:
        # the input position in the key makes it unique: a fast unstable sort keeps input order
        key = np.zeros(size, dtype=np.int64)
        for k, bound in zip(reversed(keys), reversed(bounds)):
            key = key * bound + k
        order = np.argsort(key * size + np.arange(size))
        sorted_key = key[order]
        first = np.ones(size, dtype=bool)
        first[1:] = sorted_key[1:] != sorted_key[:-1]
        return order, first
    order = np.lexsort(keys)
    first = np.ones(size, dtype=bool)
    first[1:] = np.any([k[order][1:] != k[order][:-1] for k in keys], axis=0)
    return order, first
