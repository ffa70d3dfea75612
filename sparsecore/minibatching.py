"""Minibatching: a batch whose ids overflow a partition's limits, split into k passes that each fit,
as jax-tpu-embedding defines them (``enable_minibatching``).

Every merged entry goes to one of 64 buckets by the HighwayHash of its column id (shard row * N +
destination SparseCore), so all of a row's entries share a bucket. Per partition (source chunk,
destination) the ids and the unique ids of each bucket are counted; a binary tree over the 64
buckets merges neighbours while their sum fits the limit and splits them otherwise (the split of
every partition OR-ed, across ranks too: ``agree``). The resulting k <= 64 minibatches are runs of
neighbouring buckets. A row lives in one minibatch, so k passes of a lookup sum to the one-pass
lookup and k fused updates touch disjoint rows: together they are the one-pass update.

Two layouts of the same minibatches:

- :func:`jte_buffers`: jax-tpu-embedding's device input for its minibatching kernels, per device:
  row pointers ``[S * 64 * max(N, 8)]`` (source SparseCore-major, then minibatch, then partition;
  pointers index the device's COO buffer), COO buffers of ``round_up(max_ids, 8) * S * N * 64``
  entries, segments packed in that order, each partition 8-aligned;
- :attr:`MinibatchedStack.passes`: one ordinary CSR per minibatch (``sparsecore.csr_format``), the
  input of ``sparsecore.csr_math`` and the ``tpu::`` ops, padded with empty passes up to
  :func:`pass_bucket` (k rounded up to a power of two) so that a compiled step sees few shapes.

Stats are the whole batch's (as without minibatching). Tested byte for byte against
jax-tpu-embedding 0.1.0's ``preprocess_sparse_dense_matmul_input(enable_minibatching=True)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from sparsecore.csr_format import (
    StackCSR,
    lay_out_csr,
    partition_stats,
    round_up_array,
    row_pointers_per_sc,
)
from sparsecore.highway_hash import highway_hash_int32
from sparsecore.limits import PartitionOverflowError, StackStats
from sparsecore.stacking import StackedTable, StackingPlan
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
    """Each column id's minibatching bucket in [0, 64)."""
    return (highway_hash_int32(col_ids, BUCKET_HASH_KEY) & np.uint64(MAX_MINIBATCHES - 1)).astype(np.int64)


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


@dataclass(frozen=True)
class MinibatchedStack:
    """One stack's batch as k minibatches: ``passes`` (ordinary CSR, k padded to :func:`pass_bucket`
    with empty passes) and the entries they came from."""

    entries: MinibatchEntries
    passes: tuple[StackCSR, ...]

    @property
    def num_minibatches(self) -> int:
        return self.entries.num_minibatches

    @property
    def stats(self) -> StackStats:
        return self.entries.stats


def preprocess_minibatched(inputs: Mapping[str, FeatureInput], plan: StackingPlan,
                           agree: Agree | None = None) -> dict[str, MinibatchedStack]:
    """Every stack of ``plan`` over ``inputs`` as minibatches that fit its limits (one where the
    batch fits); ``agree``: OR of the split bits over ranks (None: one rank). 0 ids dropped; a
    batch that no split fits (one bucket's ids alone over a limit in one partition, e.g. a hot
    row in more samples of one source SparseCore than max_ids_per_partition) raises
    :class:`PartitionOverflowError`."""
    from sparsecore.preprocess import check_table_ids

    check_table_ids(inputs, plan)
    devices, s = plan.topology.num_devices, plan.topology.sparsecores_per_device
    out = {}
    for stack in plan.stacks:
        entries = minibatch_entries(stack, inputs, devices, s, agree)
        passes = tuple(pass_csr(stack, entries, devices, s, m) for m in range(pass_bucket(entries.num_minibatches)))
        out[stack.name] = MinibatchedStack(entries, passes)
    return out


def minibatch_entries(stack: StackedTable, inputs: Mapping[str, FeatureInput], devices: int, s: int,
                      agree: Agree | None = None) -> MinibatchEntries:
    """``stack``'s merged entries of ``inputs``, sorted into minibatches (see module docstring)."""
    from sparsecore.preprocess import coo_entries, sort_and_merge

    n, chunks = stack.num_sparsecores, devices * s
    chunk, dest, row, sample, gain = coo_entries(stack, inputs, chunks)
    chunk, dest, row, sample, gain, _ = sort_and_merge(chunk, dest, row, sample, gain, n, stack.shard_rows,
                                                        stack.total_sample_count // chunks)
    partition = chunk * n + dest
    first_of_row = np.ones(partition.size, dtype=bool)
    first_of_row[1:] = (partition[1:] != partition[:-1]) | (row[1:] != row[:-1])
    counts = np.bincount(partition, minlength=chunks * n)
    unique_counts = np.bincount(partition[first_of_row], minlength=chunks * n)
    stats = partition_stats(counts, unique_counts, devices, s, n)
    over = counts.max(initial=0) > stack.max_ids_per_partition or \
        unique_counts.max(initial=0) > stack.max_unique_ids_per_partition
    bucket = bucket_of(row * n + dest) if over or agree is not None else np.zeros(row.size, dtype=np.int64)
    split = _local_split(stack, partition, bucket, first_of_row, chunks * n) if over else 0
    split = split if agree is None else agree(split)
    if split == 0 and not over:
        minibatch = np.zeros(row.size, dtype=np.int64)
        return MinibatchEntries(chunk, minibatch, dest, row, sample, gain, 1, stats)
    minibatch = minibatch_of_bucket(split)[bucket]
    k = int(split).bit_count() + 1
    _check_minibatches_fit(stack, partition * k + minibatch, first_of_row, chunks * n * k, k)
    order = np.lexsort((bucket, dest, minibatch, chunk))  # stable: (row, sample) order inside a bucket
    return MinibatchEntries(chunk[order], minibatch[order], dest[order], row[order], sample[order], gain[order], k,
                            stats)


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


def _check_minibatches_fit(stack: StackedTable, key: np.ndarray, first_of_row: np.ndarray, size: int, k: int) -> None:
    """PartitionOverflowError when one minibatch of a partition is still over a limit: one bucket's
    ids alone are (a row's ids all share a bucket)."""
    n = stack.num_sparsecores
    for counts, limit, what in ((np.bincount(key, minlength=size), stack.max_ids_per_partition, "ids"),
                                (np.bincount(key[first_of_row], minlength=size), stack.max_unique_ids_per_partition,
                                 "unique ids")):
        over = np.flatnonzero(counts > limit)
        if over.size:
            partition = int(over[0]) // k
            raise PartitionOverflowError(
                f"stacked table {stack.name!r}: partition (source SC {partition // n}, destination SC "
                f"{partition % n}) got {int(counts[over[0]])} {what} in one minibatch > max_"
                f"{what.replace(' ', '_')}_per_partition {limit} (the ids of one of its "
                f"{MAX_MINIBATCHES} buckets: minibatching splits no finer)", "raise the limit")


def pass_csr(stack: StackedTable, entries: MinibatchEntries, devices: int, s: int, m: int) -> StackCSR:
    """Minibatch ``m``'s entries as an ordinary CSR (empty past the last minibatch)."""
    n = stack.num_sparsecores
    keep = entries.minibatch == m
    partition = entries.chunk[keep] * n + entries.dest[keep]
    counts = np.bincount(partition, minlength=devices * s * n)
    rank = np.arange(partition.size) - np.repeat(np.cumsum(counts) - counts, counts)
    stats = StackStats(*(np.zeros_like(a) for a in (entries.stats.max_ids_per_partition,
                                                    entries.stats.max_unique_ids_per_partition,
                                                    entries.stats.required_buffer_size_per_sc)))
    return lay_out_csr(stack, devices, s, partition, entries.row[keep], entries.sample[keep], entries.gain[keep],
                       rank, stats if m else entries.stats)


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


def stacked_passes(passes: tuple[StackCSR, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(row_pointers, embedding_ids, sample_ids, gains) of ``passes``, each [passes, ...]: the
    static-shape input of :func:`lookup_passes` and :func:`update_passes`."""
    return tuple(np.stack([getattr(csr, name) for csr in passes])
                 for name in ("row_pointers", "embedding_ids", "sample_ids", "gains"))


def lookup_passes(row_pointers, embedding_ids, sample_ids, gains, table, batch_size: int):
    """The activations [batch_size, dim] of a stack's minibatches (:func:`stacked_passes`): one
    ``sparsecore.csr_math`` lookup per pass, summed in pass order (every buffer of one host,
    devices concatenated; the whole table). Traceable: a program runs it for any k of its
    :func:`pass_bucket`."""
    import jax
    import jax.numpy as jnp

    from sparsecore import csr_math

    def one_pass(total, csr):
        return total + csr_math.sparse_dense_matmul(*csr, table, batch_size).astype(jnp.float32), None

    zero = jnp.zeros((batch_size, table.shape[1]), jnp.float32)
    total, _ = jax.lax.scan(one_pass, zero, (row_pointers, embedding_ids, sample_ids, gains))
    return total.astype(table.dtype)


def update_passes(optimizer: str, row_pointers, embedding_ids, sample_ids, gains, table, slots, activations_grad,
                  hypers):
    """The fused ``optimizer`` update of a stack's minibatches (:func:`stacked_passes`), pass after
    pass (they touch disjoint rows); returns the new table (and slots) as
    ``sparsecore.csr_math.fused_update``. Traceable, like :func:`lookup_passes`."""
    import jax

    from sparsecore import csr_math

    def one_pass(state, csr):
        out = csr_math.fused_update(optimizer, *csr, state[0], list(state[1:]), activations_grad, hypers)
        return (out if isinstance(out, tuple) else (out,)), None

    state, _ = jax.lax.scan(one_pass, (table, *slots), (row_pointers, embedding_ids, sample_ids, gains))
    return state if slots else state[0]
