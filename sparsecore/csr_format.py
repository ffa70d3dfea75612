"""The CSR-wrapped COO device input of one stacked table, as both preprocessing engines build it
(:mod:`sparsecore.preprocess`, numpy; :mod:`sparsecore.preprocess_native`, the C++ extension):
the buffers, their static sizes, each step's partition demand and the error of a partition over
its limit. See :mod:`sparsecore.preprocess` for the layout."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsecore.limits import PartitionOverflowError, StackStats
from sparsecore.stacking import StackedTable
from tpu_facts import ALIGNMENT as ALIGN
from tpu_facts import PADDING_ID, round_up


@dataclass(frozen=True)
class StackCSR:
    """Device input of one stacked table for all devices, concatenated device-major."""

    row_pointers: np.ndarray  # int32 [devices * S * max(N, 8)]
    embedding_ids: np.ndarray  # int32 [devices * coo_buffer_size_per_device]
    sample_ids: np.ndarray  # int32, same shape
    gains: np.ndarray  # float32, same shape
    stats: StackStats


@dataclass(frozen=True)
class RowOrderedEntries:
    """The entries one stack's CSR buffers hold (merged, within the limits), sorted by (physical
    row, source SparseCore, sample) instead of by partition: what a lookup on the host side needs.
    Inside each sample they keep the CSR order, and inside each row the order of the sources."""

    phys: np.ndarray  # int64 physical row (destination SC * shard_rows + shard row)
    sample: np.ndarray  # int64 row of the stack's activations: source SC * samples_per_chunk + sample id
    gain: np.ndarray  # float32
    stats: StackStats


def coo_buffer_size_per_device(stack: StackedTable, sparsecores_per_device: int) -> int:
    """Static COO entries per device: every partition at its padded limit (jax-tpu-embedding)."""
    return round_up(stack.max_ids_per_partition, ALIGN) * stack.num_sparsecores * sparsecores_per_device


def row_pointers_per_sc(stack: StackedTable) -> int:
    return max(stack.num_sparsecores, ALIGN)


def partition_stats(counts: np.ndarray, unique_counts: np.ndarray, devices: int, s: int, n: int) -> StackStats:
    """A step's demand from the (unique) id counts of every partition, source-major."""
    return StackStats(
        counts.reshape(devices, s, n).max(axis=1).reshape(-1).astype(np.int32),
        unique_counts.reshape(devices, s, n).max(axis=1).reshape(-1).astype(np.int32),
        round_up_array(counts, ALIGN).reshape(devices * s, n).sum(axis=1).astype(np.int32),
    )


def round_up_array(values: np.ndarray, multiple: int) -> np.ndarray:
    return -(-values // multiple) * multiple


def raise_partition_overflow(stack: StackedTable, counts: np.ndarray, unique_counts: np.ndarray, n: int) -> None:
    """Raise the PartitionOverflowError naming ``stack``'s first partition over a limit."""
    over = np.flatnonzero(counts > stack.max_ids_per_partition)
    if over.size:
        k = int(over[0])
        raise PartitionOverflowError(
            f"stacked table {stack.name!r}: partition (source SC {k // n}, destination SC {k % n}) got "
            f"{int(counts[k])} ids > max_ids_per_partition {stack.max_ids_per_partition} "
            f"({over.size} partitions over)"
        )
    k = int(np.flatnonzero(unique_counts > stack.max_unique_ids_per_partition)[0])
    raise PartitionOverflowError(
        f"stacked table {stack.name!r}: partition (source SC {k // n}, destination SC {k % n}) got "
        f"{int(unique_counts[k])} unique ids > max_unique_ids_per_partition "
        f"{stack.max_unique_ids_per_partition}"
    )


def lay_out_csr(stack: StackedTable, devices: int, s: int, partition: np.ndarray, row: np.ndarray,
                sample: np.ndarray, gain: np.ndarray, rank: np.ndarray, stats: StackStats) -> StackCSR:
    """The buffers holding each entry (its ``partition`` = source chunk * N + destination, shard
    ``row``, chunk-local ``sample``, ``gain``) at ``rank`` inside its partition, every partition
    8-aligned in its source SparseCore's region, padding elsewhere (module :mod:`sparsecore.preprocess`)."""
    n, chunks = stack.num_sparsecores, devices * s
    counts = np.bincount(partition, minlength=chunks * n)
    padded = round_up_array(counts, ALIGN).reshape(chunks, n)
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
