"""Host preprocessing: sparse ids -> per-SparseCore CSR-wrapped COO buffers (vectorized numpy).

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

from sparsecore.limits import OVERFLOW_POLICIES, PartitionOverflowError, StackStats
from sparsecore.stacking import StackedTable, StackingPlan, round_up
from sparsecore.validation import FeatureInput, feature_inputs

PADDING_ID = 2**31 - 1
ALIGN = 8


@dataclass(frozen=True)
class StackCSR:
    """Device input of one stacked table for all devices, concatenated device-major."""

    row_pointers: np.ndarray  # int32 [devices * S * max(N, 8)]
    embedding_ids: np.ndarray  # int32 [devices * coo_buffer_size_per_device]
    sample_ids: np.ndarray  # int32, same shape
    gains: np.ndarray  # float32, same shape
    stats: StackStats


@dataclass(frozen=True)
class PreprocessedBatch:
    stacks: dict[str, StackCSR]

    @property
    def stats(self) -> dict[str, StackStats]:
        return {name: csr.stats for name, csr in self.stacks.items()}


def coo_buffer_size_per_device(stack: StackedTable, sparsecores_per_device: int) -> int:
    """Static COO entries per device: every partition at its padded limit (jax-tpu-embedding)."""
    return round_up(stack.max_ids_per_partition, ALIGN) * stack.num_sparsecores * sparsecores_per_device


def row_pointers_per_sc(stack: StackedTable) -> int:
    return max(stack.num_sparsecores, ALIGN)


def preprocess(
    kjt: KeyedJaggedTensor,
    plan: StackingPlan,
    *,
    overflow: str = "error",
    id_policy: str = "error",
) -> PreprocessedBatch:
    """Validate a KJT and build the CSR buffers of every stack (see module docstring)."""
    inputs = feature_inputs(kjt, plan.features, plan.tables, id_policy)
    return preprocess_inputs(inputs, plan, overflow=overflow)


def preprocess_inputs(
    inputs: Mapping[str, FeatureInput], plan: StackingPlan, *, overflow: str = "error", threads: int | None = None
) -> PreprocessedBatch:
    """Build the CSR buffers from already validated per-feature inputs; stacks are built on
    ``threads`` threads (default: one per stack, up to the CPU count; numpy sorts release the GIL)."""
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow policy must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    devices, s = plan.topology.num_devices, plan.topology.sparsecores_per_device
    threads = threads or min(len(plan.stacks), os.cpu_count() or 1)

    def build(stack: StackedTable) -> StackCSR:
        return _preprocess_stack(stack, inputs, devices, s, overflow)

    if threads <= 1:
        return PreprocessedBatch({stack.name: build(stack) for stack in plan.stacks})
    with ThreadPoolExecutor(threads) as pool:
        return PreprocessedBatch(dict(zip((st.name for st in plan.stacks), pool.map(build, plan.stacks))))


def _preprocess_stack(
    stack: StackedTable, inputs: Mapping[str, FeatureInput], devices: int, s: int, overflow: str
) -> StackCSR:
    n = stack.num_sparsecores
    chunks = devices * s
    samples_per_chunk = stack.total_sample_count // chunks
    chunk, dest, row, sample, gain = _coo_entries(stack, inputs, chunks)
    chunk, dest, row, sample, gain, multiplicity = _sort_and_merge(
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
    stats = StackStats(
        counts.reshape(devices, s, n).max(axis=1).reshape(-1).astype(np.int32),
        unique_counts.reshape(devices, s, n).max(axis=1).reshape(-1).astype(np.int32),
        _round_up_array(counts, ALIGN).reshape(chunks, n).sum(axis=1).astype(np.int32),
    )
    keep = (rank < stack.max_ids_per_partition) & (unique_rank < stack.max_unique_ids_per_partition)
    if not keep.all():
        if overflow == "error":
            _raise_overflow(stack, counts, unique_counts, n)
        stats.dropped_ids = int(multiplicity[~keep].sum())  # input ids, counted before merging
        partition, row, sample, gain, rank = (a[keep] for a in (partition, row, sample, gain, rank))
        counts = np.bincount(partition, minlength=num_partitions)

    padded = _round_up_array(counts, ALIGN).reshape(chunks, n)
    ends_padded = np.cumsum(padded, axis=1)
    starts = (ends_padded - padded).reshape(-1)
    region = coo_buffer_size_per_device(stack, s) // s
    pointers = np.empty((chunks, row_pointers_per_sc(stack)), dtype=np.int32)
    pointers[:, :n] = (starts + counts).reshape(chunks, n)
    pointers[:, n:] = ends_padded[:, -1:]

    size = devices * region * s
    embedding_ids = np.full(size, PADDING_ID, dtype=np.int32)
    sample_ids = np.full(size, PADDING_ID, dtype=np.int32)
    gains = np.full(size, np.nan, dtype=np.float32)
    position = (partition // n) * region + starts[partition] + rank
    embedding_ids[position] = row
    sample_ids[position] = sample
    gains[position] = gain
    return StackCSR(pointers.reshape(-1), embedding_ids, sample_ids, gains, stats)


def _coo_entries(stack: StackedTable, inputs: Mapping[str, FeatureInput], chunks: int):
    """Per id of every feature of the stack: (chunk, destination SC, shard row, sample, gain)."""
    n = stack.num_sparsecores
    parts = []
    for fp in stack.features:
        x = inputs[fp.feature]
        per_chunk = fp.batch_size // chunks
        sample = np.repeat(np.arange(fp.batch_size, dtype=np.int64), x.lengths)
        gain = combined_gains(x.weights, x.lengths, sample, stack.combiner)
        parts.append((
            sample // per_chunk,
            (x.ids % n + fp.col_shift) % n,
            (x.ids + fp.col_offset) // n,
            sample % per_chunk + fp.sample_offset // chunks,
            gain,
        ))
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(5))


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


def _sort_and_merge(chunk, dest, row, sample, gain, n, shard_rows, samples_per_chunk):
    """Sort by (chunk, dest, row, sample) and merge equal keys, summing their gains; also
    returns how many input ids each merged entry stands for."""
    if chunk.size == 0:
        return chunk, dest, row, sample, gain, np.zeros(0, dtype=np.int64)
    size = chunk.size
    bound = (int(chunk.max()) + 1) * n * shard_rows * samples_per_chunk
    if bound * size < 2**63:
        # the input position in the key makes it unique: a fast unstable sort keeps input order
        # among equal (chunk, dest, row, sample), which fixes the float32 summation order
        key = (((chunk * n + dest) * shard_rows + row) * samples_per_chunk + sample) * size
        order = np.argsort(key + np.arange(size))
        sorted_key = key[order]
        first = np.ones(size, dtype=bool)
        first[1:] = sorted_key[1:] != sorted_key[:-1]
    else:
        order = np.lexsort((sample, row, dest, chunk))
        first = np.ones(chunk.size, dtype=bool)
        first[1:] = np.any([a[order][1:] != a[order][:-1] for a in (chunk, dest, row, sample)], axis=0)
    starts = np.flatnonzero(first)
    multiplicity = np.diff(np.append(starts, chunk.size))
    merged_gain = _sequential_f32_sum(gain[order].astype(np.float64), starts, multiplicity)
    picked = order[starts]
    return chunk[picked], dest[picked], row[picked], sample[picked], merged_gain, multiplicity


def _round_up_array(values: np.ndarray, multiple: int) -> np.ndarray:
    return -(-values // multiple) * multiple


def _raise_overflow(stack: StackedTable, counts: np.ndarray, unique_counts: np.ndarray, n: int) -> None:
    over = np.flatnonzero(counts > stack.max_ids_per_partition)
    if over.size:
        k = int(over[0])
        raise PartitionOverflowError(
            f"stacked table {stack.name!r}: partition (source SC {k // n}, destination SC {k % n}) got "
            f"{int(counts[k])} ids > max_ids_per_partition {stack.max_ids_per_partition} "
            f"({over.size} partitions over); raise the limit (see sparsecore.limits.FdoRecorder) or "
            "use overflow='drop'"
        )
    k = int(np.flatnonzero(unique_counts > stack.max_unique_ids_per_partition)[0])
    raise PartitionOverflowError(
        f"stacked table {stack.name!r}: partition (source SC {k // n}, destination SC {k % n}) got "
        f"{int(unique_counts[k])} unique ids > max_unique_ids_per_partition "
        f"{stack.max_unique_ids_per_partition}; raise the limit or use overflow='drop'"
    )
