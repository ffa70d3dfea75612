"""Minibatching: a batch whose ids overflow a partition's limits, split into k passes that each fit,
as jax-tpu-embedding defines them (``enable_minibatching``).

Every merged entry goes to one of 64 buckets by the HighwayHash of its column id (shard row * N +
destination SparseCore), so all of a row's entries share a bucket. Per partition (source chunk,
destination) the ids and the unique ids of each bucket are counted; a binary tree over the 64
buckets merges neighbours while their sum fits the limit and splits them otherwise (the split of
every partition OR-ed, across ranks too: ``agree``). The resulting k <= 64 minibatches are runs of
neighbouring buckets. A row lives in one minibatch, so k passes of a lookup sum to the one-pass
lookup and k fused updates touch disjoint rows: together they are the one-pass update.

The minibatches reach the device in jax-tpu-embedding's layout (:func:`jte_buffers`), per device:
row pointers ``[S * 64 * max(N, 8)]`` (source SparseCore-major, then minibatch, then partition;
pointers index the device's COO buffer), COO buffers of ``round_up(max_ids, 8) * S * N * 64``
entries, segments packed in that order, each partition 8-aligned; the ``tpu::`` ops take it with
:func:`pass_bucket` (k rounded up to a power of two) slots (:func:`op_buffers`), so that a compiled
step sees few shapes. A backend with no static buffers (``xla``) keeps every entry, the sum of
the passes, and only checks that a split fits (:func:`check_split_fits`).

The host work is the compiled preprocessing's where it builds (its merge of the entries, its
HighwayHash), each column id hashed once a process (:func:`known_bucket_of`). Stats are the whole
batch's (as without minibatching). Tested byte for byte against jax-tpu-embedding 0.1.0's
``preprocess_sparse_dense_matmul_input(enable_minibatching=True)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from sparsecore.csr_format import (
    RowOrderedEntries,
    StackCSR,
    partition_stats,
    round_up_array,
    row_pointers_per_sc,
)
from sparsecore.highway_hash import highway_hash
from sparsecore.limits import PartitionOverflowError, StackStats
from sparsecore.stacking import StackedTable
from sparsecore.validation import FeatureInput
from tpu_facts import ALIGNMENT as ALIGN
from tpu_facts import MAX_MINIBATCHES, PADDING_ID, round_up

BUCKET_HASH_KEY = (0x4451E30F87DB9609, 0xCA7358A1FD2737F8, 0x4B2C991FCEE4FDEA, 0x0B2658E18326F6BA)

Agree = Callable[[int], int]  # this rank's split bits -> every rank's, OR-ed


def agree_over_ranks(group=None) -> Agree:
    """An ``agree`` that ORs the split bits of every rank of ``group`` (torch.distributed; None:
    the default group): a collective, so every rank preprocesses the same stacks in order."""
    import torch
    import torch.distributed as dist

    def agree(split: int) -> int:
        bits = torch.tensor([split], dtype=torch.int64)
        dist.all_reduce(bits, op=dist.ReduceOp.BOR, group=group)
        return int(bits.item())

    return agree


def bucket_of(col_ids: np.ndarray) -> np.ndarray:
    """Each column id's minibatching bucket in [0, 64) (ids of 0 to 2^31 - 1)."""
    return (highway_hash(col_ids, BUCKET_HASH_KEY) & np.uint64(MAX_MINIBATCHES - 1)).astype(np.int64)


_known = np.zeros(0, dtype=np.uint8)  # 1 + the bucket of each column id hashed so far (0: not yet)


def known_bucket_of(col_ids: np.ndarray) -> np.ndarray:
    """:func:`bucket_of`, hashing each column id once a process (a skewed stream minibatches the
    same rows batch after batch; the hash costs far more than a look-up). The memo grows to the
    largest id seen (a byte each; concurrent callers may hash an id twice, never differently)."""
    global _known
    known = _known
    if col_ids.size and int(col_ids.max()) >= known.size:
        grown = np.zeros(max(int(col_ids.max()) + 1, 2 * known.size), dtype=np.uint8)
        grown[:known.size] = known
        _known = known = grown
    out = known[col_ids]
    missing = out == 0
    if missing.any():
        out[missing] = known[col_ids[missing]] = bucket_of(col_ids[missing]) + 1
    return out.astype(np.int64) - 1


def split_of(per_bucket: np.ndarray, limit: int) -> int:
    """The split bits (63, bit i = tree node i split) of one partition's counts per bucket [64]:
    level by level from pairs of buckets up, a node whose two children sum over ``limit`` splits
    (and carries the larger child up), else merges (and carries the sum)."""
    values = [int(v) for v in per_bucket]
    split, index, size = 0, 0, 2
    while size <= MAX_MINIBATCHES:
        for i in range(0, MAX_MINIBATCHES, size):
            left, right = values[i], values[i + size // 2]
            if left + right > limit:
                split |= 1 << index
                values[i] = max(left, right)
            else:
                values[i] = left + right
            index += 1
        size *= 2
    return split


def minibatch_of_bucket(split: int) -> np.ndarray:
    """Each bucket's minibatch [64] under ``split``: bucket j starts a new minibatch where the tree
    node whose halves meet between j - 1 and j is split."""
    starts = np.zeros(MAX_MINIBATCHES, dtype=np.int64)
    for j in range(1, MAX_MINIBATCHES):
        level = (j & -j).bit_length() - 1  # halves of size 2^level meet at j
        size = 2 << level
        first_index = sum(MAX_MINIBATCHES // (2 << lv) for lv in range(level))
        starts[j] = (split >> (first_index + (j - size // 2) // size)) & 1
    return np.cumsum(starts)


def pass_bucket(k: int) -> int:
    """The passes a step runs for k minibatches: k rounded up to a power of two (<= 64)."""
    return 1 << (k - 1).bit_length()


@dataclass(frozen=True)
class MinibatchEntries:
    """One stack's merged entries in minibatch order (source chunk, minibatch, destination, then
    bucket, shard row, sample where minibatching is on; else the one-pass order)."""

    chunk: np.ndarray
    minibatch: np.ndarray
    dest: np.ndarray
    row: np.ndarray
    sample: np.ndarray
    gain: np.ndarray
    num_minibatches: int
    stats: StackStats


def minibatch_entries(stack: StackedTable, inputs: Mapping[str, FeatureInput], devices: int, s: int,
                      agree: Agree | None = None, engine: str = "auto") -> MinibatchEntries:
    """``stack``'s merged entries of ``inputs``, sorted into minibatches (see module docstring);
    ``engine``: the preprocessing's (``sparsecore.preprocess.ENGINES``) that merges them."""
    n, chunks = stack.num_sparsecores, devices * s
    chunk, dest, row, sample, gain = _merged_entries(stack, inputs, devices, s, engine)
    partition = chunk * n + dest
    first_of_row = np.ones(partition.size, dtype=bool)
    first_of_row[1:] = (partition[1:] != partition[:-1]) | (row[1:] != row[:-1])
    counts = np.bincount(partition, minlength=chunks * n)
    unique_counts = np.bincount(partition[first_of_row], minlength=chunks * n)
    stats = partition_stats(counts, unique_counts, devices, s, n)
    over = counts.max(initial=0) > stack.max_ids_per_partition or \
        unique_counts.max(initial=0) > stack.max_unique_ids_per_partition
    bucket = known_bucket_of(row * n + dest) if over or agree is not None else np.zeros(row.size, dtype=np.int64)
    if over:
        _check_buckets_fit(stack, partition, bucket, first_of_row, chunks * n)
    split = _local_split(stack, partition, bucket, first_of_row, chunks * n) if over else 0
    split = split if agree is None else agree(split)
    if split == 0 and not over:
        minibatch = np.zeros(row.size, dtype=np.int64)
        return MinibatchEntries(chunk, minibatch, dest, row, sample, gain, 1, stats)
    minibatch = minibatch_of_bucket(split)[bucket]
    k = int(split).bit_count() + 1
    segment = (chunk * k + minibatch) * n + dest
    order = stable_order(segment * MAX_MINIBATCHES + bucket, chunks * k * n * MAX_MINIBATCHES)  # (row, sample) kept
    return MinibatchEntries(chunk[order], minibatch[order], dest[order], row[order], sample[order], gain[order], k,
                            stats)


def check_split_fits(stack: StackedTable, entries: RowOrderedEntries, chunks: int) -> None:
    """PartitionOverflowError where no minibatches fit ``stack``'s limits (``entries``: all of a
    batch's, in row order, from ``chunks`` source SparseCores): one of a partition's buckets
    alone over a limit. Else the split tree fits every partition: a node that splits carries its
    larger half, which fits, and one that merges fits by its test. Only partitions over a limit
    are hashed."""
    n, samples_per_chunk = stack.num_sparsecores, stack.total_sample_count // chunks
    chunk, dest = entries.sample // samples_per_chunk, entries.phys // stack.shard_rows
    partition = chunk * n + dest
    first_of_row = np.ones(partition.size, dtype=bool)  # row order: (row, source) runs
    first_of_row[1:] = (entries.phys[1:] != entries.phys[:-1]) | (chunk[1:] != chunk[:-1])
    over = (np.bincount(partition, minlength=chunks * n) > stack.max_ids_per_partition) | \
        (np.bincount(partition[first_of_row], minlength=chunks * n) > stack.max_unique_ids_per_partition)
    at = over[partition]
    row = entries.phys[at] % stack.shard_rows
    _check_buckets_fit(stack, partition[at], known_bucket_of(row * n + dest[at]), first_of_row[at], chunks * n)


def _merged_entries(stack: StackedTable, inputs: Mapping[str, FeatureInput], devices: int, s: int,
                    engine: str) -> tuple[np.ndarray, ...]:
    """(source chunk, destination SC, shard row, chunk-local sample, gain) of ``stack``'s merged
    entries of ``inputs``, by (chunk, destination, row, sample)."""
    from sparsecore.preprocess import coo_entries, sort_and_merge, use_compiled

    chunks = devices * s
    if not use_compiled(engine, "minibatch"):
        chunk, dest, row, sample, gain = coo_entries(stack, inputs, chunks)
        return sort_and_merge(chunk, dest, row, sample, gain, stack.num_sparsecores, stack.shard_rows,
                              stack.total_sample_count // chunks)[:5]
    from sparsecore.preprocess_native import preprocess_stacks_compiled

    entries = preprocess_stacks_compiled(inputs, [stack], devices, s, "minibatch", None, True)[stack.name]
    samples_per_chunk = stack.total_sample_count // chunks
    order = stable_order(entries.sample // samples_per_chunk, chunks)  # row order -> source-major
    phys, sample = entries.phys[order], entries.sample[order]
    return (sample // samples_per_chunk, phys // stack.shard_rows, phys % stack.shard_rows, sample % samples_per_chunk,
            entries.gain[order])


def stable_order(key: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` of keys in [0, ``bound``), by passes over 16 bits of
    them (numpy radix-sorts 16-bit keys: a tenth of a comparison sort's time)."""
    order = np.arange(key.size)
    for shift in range(0, max(int(bound) - 1, 1).bit_length(), 16):
        digit = ((key[order] >> shift) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(digit, kind="stable")]
    return order


def _local_split(stack: StackedTable, partition: np.ndarray, bucket: np.ndarray, first_of_row: np.ndarray,
                 partitions: int) -> int:
    """The OR of every partition's split for its ids and its unique ids per bucket."""
    key = partition * MAX_MINIBATCHES + bucket
    ids = np.bincount(key, minlength=partitions * MAX_MINIBATCHES).reshape(partitions, MAX_MINIBATCHES)
    unique = np.bincount(key[first_of_row], minlength=partitions * MAX_MINIBATCHES).reshape(partitions,
                                                                                           MAX_MINIBATCHES)
    split = 0
    for p in np.flatnonzero((ids.sum(axis=1) > stack.max_ids_per_partition) |
                            (unique.sum(axis=1) > stack.max_unique_ids_per_partition)):
        split |= split_of(ids[p], stack.max_ids_per_partition) | split_of(unique[p], stack.max_unique_ids_per_partition)
    return split


def _check_buckets_fit(stack: StackedTable, partition: np.ndarray, bucket: np.ndarray, first_of_row: np.ndarray,
                       partitions: int) -> None:
    """PartitionOverflowError when one bucket of a partition is over a limit: its ids form one
    minibatch at the finest split (a row's ids all share a bucket)."""
    n, key = stack.num_sparsecores, partition * MAX_MINIBATCHES + bucket
    size = partitions * MAX_MINIBATCHES
    for counts, limit, what in ((np.bincount(key, minlength=size), stack.max_ids_per_partition, "ids"),
                                (np.bincount(key[first_of_row], minlength=size), stack.max_unique_ids_per_partition,
                                 "unique ids")):
        over = np.flatnonzero(counts > limit)
        if over.size:
            p = int(over[0]) // MAX_MINIBATCHES
            raise PartitionOverflowError(
                f"stacked table {stack.name!r}: partition (source SC {p // n}, destination SC {p % n}) got "
                f"{int(counts[over[0]])} {what} in one minibatch > max_{what.replace(' ', '_')}_per_partition "
                f"{limit} (the ids of one of its {MAX_MINIBATCHES} buckets: minibatching splits no finer)",
                "raise the limit")


def jte_buffers(stack: StackedTable, entries: MinibatchEntries, devices: int, s: int,
                slots: int = MAX_MINIBATCHES) -> StackCSR:
    """The minibatches in jax-tpu-embedding's minibatching layout (module docstring) with room for
    ``slots`` minibatches (jax-tpu-embedding's: 64; the ``tpu::`` ops': :func:`pass_bucket` of k),
    all devices concatenated device-major; row pointers past the k minibatches repeat the
    device's end."""
    n, k = stack.num_sparsecores, entries.num_minibatches
    if not k <= slots <= MAX_MINIBATCHES:
        raise ValueError(f"stacked table {stack.name!r}: {k} minibatches need {k} to {MAX_MINIBATCHES} slots, got "
                         f"{slots}")
    width = row_pointers_per_sc(stack)
    segment = (entries.chunk * k + entries.minibatch) * n + entries.dest  # device-major, then SC, MB, partition
    counts = np.bincount(segment, minlength=devices * s * k * n).reshape(devices, s * k * n)
    padded = round_up_array(counts, ALIGN)
    ends = np.cumsum(padded, axis=1)
    starts = ends - padded
    size = round_up(stack.max_ids_per_partition, ALIGN) * s * n * slots
    pointers = np.repeat(ends[:, -1:], s * slots * width, axis=1).astype(np.int32)
    used = pointers[:, :s * k * width].reshape(devices, s * k, width)
    used[:, :, :n] = (starts + counts).reshape(devices, s * k, n)
    used[:, :, n:] = ends.reshape(devices, s * k, n)[:, :, -1:]
    pointers[:, :s * k * width] = used.reshape(devices, -1)
    flat_first = starts.reshape(-1)
    rank = np.arange(segment.size) - np.repeat(np.cumsum(counts.reshape(-1)) - counts.reshape(-1), counts.reshape(-1))
    position = (entries.chunk // s) * size + flat_first[segment] + rank
    embedding_ids = np.full(devices * size, PADDING_ID, dtype=np.int32)
    sample_ids = np.full(devices * size, PADDING_ID, dtype=np.int32)
    gains = np.full(devices * size, np.nan, dtype=np.float32)
    embedding_ids[position] = entries.row
    sample_ids[position] = entries.sample
    gains[position] = entries.gain
    return StackCSR(pointers.reshape(-1), embedding_ids, sample_ids, gains, entries.stats)

def op_buffers(stack: StackedTable, entries: MinibatchEntries, devices: int, s: int, slots: int | None = None,
               ) -> StackCSR:
    """The ``tpu::`` ops' minibatched input (their ``num_minibatches`` = ``slots``, default
    :func:`pass_bucket` of k, so that a program sees few shapes): jax-tpu-embedding's layout of
    ``slots`` minibatches, those past the k of ``entries`` empty."""
    slots = pass_bucket(entries.num_minibatches) if slots is None else slots
    return jte_buffers(stack, replace(entries, num_minibatches=slots), devices, s, slots)
