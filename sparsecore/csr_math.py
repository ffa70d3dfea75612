"""The SparseCore lookup and its fused updates as functions of CSR-wrapped COO buffers
(``sparsecore.csr_format``), used by the ``tpu::sparse_dense_matmul*`` torch ops
(``torch_tpu.ops.sparsecore``) off TPU: the buffers decoded (:func:`decode`) and deduplicated
(:func:`touched_rows`) into the core's record (:func:`csr_entries`), then the core's lookup and
update (``sparsecore.entries``), the same the ``xla`` backend runs on entries made on the host.

Mod sharding over N SparseCores: source SparseCore k's region of ``embedding_ids`` /
``sample_ids`` / ``gains`` holds its N partitions, partition p being ``[round_up(end[p-1], 8),
end[p])`` with ``end = row_pointers[k * R : k * R + N]`` (R = max(N, 8) pointers per region);
every other position is padding. An entry of partition p of source k reads shard row
``embedding_id`` of SparseCore p and adds ``gain * row`` to activation row ``k * (batch / K) +
sample_id`` (K source regions).

The buffers given are either one device's with N = S (one device of S SparseCores) or the
buffers of all D devices of a job concatenated device-major (what an all_gather of every
device's buffers gives): then there are K = D * S = N source regions, again as many as
partitions, so N is read from the row-pointer size either way. The table holds the rows of
``devices`` equal blocks of partitions, ``device_index``'s block (the ``Shard(0)`` of the
stacked table on that device): with ``devices=1`` every partition, ``physical row = p *
shard_rows + embedding_id``; otherwise entries of other devices' partitions are dropped, so the
lookup is that device's partial sum over the global batch and the gradient that of its rows.

For every activation row (and every table row) the buffers hold the entries in the order the
``xla`` backend sums them (by physical row, then source SparseCore, then sample), and sorting by
(row, position) keeps it: on one device the lookup is bit-identical to
``XlaBackend.stack_activations``.

Minibatched buffers (``minibatches`` = K > 1; jax-tpu-embedding's minibatching layout with K
slots, ``sparsecore.minibatching.op_buffers``; one device's, N = S): per source SparseCore, K
groups of R pointers (each partition's end as a position in the whole buffer), the segments
(source, minibatch, partition) packed in that order, each 8-aligned. The minibatches touch
disjoint rows, so their entries together are one pass's, and sorted by (row, position) they are in
one pass's order: the lookup and the update equal one pass's bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparsecore.csr_format import RowOrderedEntries, StackCSR
from sparsecore.entries import DEFAULT_BUCKETS, Buckets, Entries, dense_grad, first_of_runs, lookup, update
from sparsecore.optimizer_rules import rule_named
from tpu_facts import ALIGNMENT


def sparsecores_per_device(row_pointers_size: int, devices: int = 1) -> int:
    """S from the row-pointer buffer of one of ``devices`` devices: S regions of max(devices * S, 8)
    pointers. With ``devices`` = 1 and a gathered buffer of D devices this gives N = D * S."""
    for s in range(1, row_pointers_size + 1):
        if s * max(devices * s, ALIGNMENT) == row_pointers_size:
            return s
    raise ValueError(
        f"row_pointers has {row_pointers_size} entries; one of {devices} devices' buffers holds "
        f"S * max({devices} * S, {ALIGNMENT}) (S SparseCores per device)"
    )


def decode(row_pointers, embedding_ids, sample_ids, gains, stack_rows: int, device_batch_size: int, devices: int = 1,
           device_index: int = 0, xp=jnp, minibatches: int = 1):
    """(table row, activation row, gain, valid) of every buffer position, each [K * region] (K =
    N source regions). ``stack_rows`` are the rows of the op's ``embedding_table`` (a stack's):
    device ``device_index``'s block of N / ``devices`` partitions; ``device_batch_size`` is the
    op's (its activation rows). Padding positions and entries of other devices' partitions get row
    ``stack_rows`` and activation row ``device_batch_size`` (out of range: a segment sum drops
    them) and gain 0. ``xp``: ``jnp`` (in a program) or ``np`` (host arrays, on the host).
    ``minibatches``: the buffers' minibatch slots (module docstring; > 1 with ``devices`` 1 only)."""
    if minibatches > 1:
        return _decode_minibatched(row_pointers, embedding_ids, sample_ids, gains, stack_rows, device_batch_size,
                                   devices, minibatches, xp)
    n = sparsecores_per_device(row_pointers.shape[0])  # source regions = partitions (module docstring)
    if not 0 <= device_index < devices or n % devices:
        raise ValueError(
            f"device_index {device_index} of {devices} devices: needs 0 <= device_index < devices and "
            f"devices dividing the {n} partitions of the buffers"
        )
    local = n // devices  # partitions whose rows the table holds
    if embedding_ids.shape[0] % n or device_batch_size % n or stack_rows % local:
        raise ValueError(
            f"CSR buffers of {embedding_ids.shape[0]} entries and batch {device_batch_size} must divide among {n} "
            f"source SparseCores and a table of {stack_rows} rows among its {local} partitions"
        )
    region = embedding_ids.shape[0] // n
    ends = row_pointers.reshape(n, -1)[:, :n].astype(xp.int32)
    aligned = (ends[:, :-1] + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT
    starts = xp.concatenate([xp.zeros((n, 1), xp.int32), aligned], axis=1)
    position = xp.arange(region, dtype=xp.int32)
    if xp is np:  # (a search per source: the comparison cube below is N times the work)
        partition = np.stack([np.searchsorted(row, position, side="right") - 1 for row in starts]).astype(np.int32)
    else:
        partition = xp.sum(starts[:, None, :] <= position[None, :, None], axis=-1) - 1  # [N, region]
    partition = xp.clip(partition, 0, n - 1)
    valid = position[None, :] < xp.take_along_axis(ends, partition, axis=1)
    if devices > 1:
        partition = partition - device_index * local
        valid = valid & (partition >= 0) & (partition < local)
    ids = embedding_ids.reshape(n, region).astype(xp.int32)
    samples = sample_ids.reshape(n, region).astype(xp.int32)
    source = xp.arange(n, dtype=xp.int32)[:, None]
    phys = xp.where(valid, partition * (stack_rows // local) + ids, stack_rows)
    activation_row = xp.where(valid, source * (device_batch_size // n) + samples, device_batch_size)
    gain = xp.where(valid, gains.reshape(n, region), xp.float32(0))
    # computed once: XLA would otherwise fuse this arithmetic into every consumer, e.g. recompute
    # a position's partition for each of the dim elements a row gather reads
    out = (phys.reshape(-1), activation_row.reshape(-1), gain.reshape(-1), valid.reshape(-1))
    return out if xp is np else jax.lax.optimization_barrier(out)


def minibatch_partitions(row_pointers_size: int, minibatches: int) -> int:
    """N (= S) of one device's buffers with ``minibatches`` slots: ``row_pointers_size`` is S *
    ``minibatches`` * max(S, 8)."""
    if minibatches < 1 or row_pointers_size % minibatches:
        raise ValueError(f"row_pointers has {row_pointers_size} entries, not a multiple of num_minibatches "
                         f"{minibatches} (>= 1)")
    return sparsecores_per_device(row_pointers_size // minibatches)


def _decode_minibatched(row_pointers, embedding_ids, sample_ids, gains, stack_rows: int, device_batch_size: int,
                        devices: int, minibatches: int, xp):
    """:func:`decode` of minibatched buffers (module docstring)."""
    if devices != 1:
        raise ValueError(f"minibatched buffers (num_minibatches {minibatches}) are one device's; got devices={devices}")
    n = minibatch_partitions(row_pointers.shape[0], minibatches)
    if device_batch_size % n or stack_rows % n:
        raise ValueError(f"batch {device_batch_size} and a table of {stack_rows} rows must divide among {n} "
                         "SparseCores")
    ends = row_pointers.reshape(n * minibatches, -1)[:, :n].reshape(-1).astype(xp.int32)
    starts = xp.concatenate([xp.zeros((1,), xp.int32), (ends[:-1] + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT])
    position = xp.arange(embedding_ids.shape[0], dtype=xp.int32)
    # the last segment starting at or before each position (an empty segment shares its start
    # with the next one, which this finds)
    segment = xp.clip(xp.searchsorted(starts, position, side="right").astype(xp.int32) - 1, 0, ends.shape[0] - 1)
    valid = position < ends[segment]
    partition, source = segment % n, segment // (minibatches * n)
    phys = xp.where(valid, partition * (stack_rows // n) + embedding_ids.astype(xp.int32), stack_rows)
    activation_row = xp.where(valid, source * (device_batch_size // n) + sample_ids.astype(xp.int32),
                              device_batch_size)
    gain = xp.where(valid, gains, xp.float32(0))
    out = (phys, activation_row, gain, valid)
    return out if xp is np else jax.lax.optimization_barrier(out)


def row_ordered(csr: StackCSR, stack_rows: int, activation_rows: int) -> RowOrderedEntries:
    """The entries of host CSR buffers (every device's, concatenated) by (row, position): what the
    host producer (``sparsecore.entries.pack_row_ordered``) takes."""
    phys, sample, gain, valid = decode(csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains, stack_rows,
                                       activation_rows, xp=np)
    by_row = np.argsort(phys[valid], kind="stable")
    return RowOrderedEntries(*(a[valid][by_row] for a in (phys.astype(np.int64), sample.astype(np.int64), gain)),
                             csr.stats)


def _relabel(rows, mapping, out_of_range: int):
    """Activation rows ``rows`` as ``mapping[rows]``; padding's row (``len(mapping)``, past the
    mapping) becomes ``out_of_range``, which the caller's gathers and scatters drop."""
    return mapping.astype(jnp.int32).at[rows].get(mode="fill", fill_value=out_of_range)


def csr_entries(row_pointers, embedding_ids, sample_ids, gains, stack_rows: int, device_batch_size: int,
                devices: int = 1, device_index: int = 0, touched=None, dedup: bool = True, relabel=None,
                relabelled_rows: int = 0, minibatches: int = 1) -> Entries:
    """The CSR producer of :class:`~sparsecore.entries.Entries`: the buffers' entries (:func:`decode`)
    sorted by (row, position) and deduplicated with ``touched`` (:func:`touched_rows` of the same
    buffers, computed ahead), else here where ``dedup`` (else in buffer order, one row read per
    entry). ``relabel`` [device_batch_size]: activation row r becomes ``relabel[r]`` (padding: row
    ``relabelled_rows``, past the rows relabelled into). ``minibatches``: see :func:`decode`."""
    phys, rows, gain, _ = decode(row_pointers, embedding_ids, sample_ids, gains, stack_rows, device_batch_size,
                                 devices, device_index, minibatches=minibatches)
    entries = phys.shape[0]
    if relabel is not None:
        rows = _relabel(rows, relabel, relabelled_rows)
    if touched is None and not dedup:
        return Entries(phys, None, rows, gain, deduplicated=False)
    split = _touched_rows(phys, stack_rows) if touched is None else split_touched(touched, entries)
    if split is None:  # (row + 1) * entries needs 64-bit keys and x64 is off: jnp.unique's pair sort
        # touched rows ascending; padding entries (row ``stack_rows``) and unused slots read/write that
        # row: dropped
        unique, inverse = jnp.unique(phys, return_inverse=True, size=entries, fill_value=stack_rows)
        return Entries(unique, inverse.reshape(-1), rows, gain, deduplicated=False)
    order, segment, unique = split
    # the sorted entries' rows and gains composed once: XLA would otherwise fuse both gathers'
    # index arithmetic into every element of the row gathers reading them
    sorted_rows, sorted_gain = jax.lax.optimization_barrier((rows[order], gain[order]))
    return Entries(unique, segment, sorted_rows, sorted_gain)


def sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, embedding_table, device_batch_size: int,
                        devices: int = 1, device_index: int = 0, touched=None, output_rows=None, minibatches: int = 1):
    """Activations [device_batch_size, dim]: per activation row, the sum of gain * table row (over the
    table's own rows: a partial sum when ``devices`` > 1). With ``touched`` (:func:`touched_rows`
    of the same buffers) each touched row is read once (the same values, the same sums).
    ``output_rows`` (a permutation of the activation rows): activation row r is returned as row
    ``output_rows[r]`` (the caller's layout, with no permuted copy). ``minibatches``: see :func:`decode`
    (those entries are summed sorted by row: one pass's order)."""
    entries = csr_entries(row_pointers, embedding_ids, sample_ids, gains, embedding_table.shape[0],
                          device_batch_size, devices, device_index, touched, dedup=minibatches > 1,
                          relabel=output_rows, relabelled_rows=device_batch_size, minibatches=minibatches)
    return lookup(entries, embedding_table, device_batch_size)


def table_grad(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad, devices: int = 1,
               device_index: int = 0, minibatches: int = 1):
    """(gradient of the table [V, dim], touched [V] bool): per table row, the sum of gain *
    activation gradient over its entries (the table's own rows when ``devices`` > 1)."""
    stack_rows = embedding_table.shape[0]
    entries = csr_entries(row_pointers, embedding_ids, sample_ids, gains, stack_rows, activations_grad.shape[0],
                          devices, device_index, dedup=False, minibatches=minibatches)
    activations_grad = activations_grad.astype(jnp.float32)
    return dense_grad(entries, lambda rows: activations_grad.at[rows].get(mode="fill", fill_value=0.0), stack_rows)


def _touched_rows(phys, stack_rows: int, xp=jnp):
    """The rows ``phys`` (one per buffer position; ``stack_rows``: padding) touch, deduplicated without
    a comparator sort: in a program one sort of single integer keys row * E + position (XLA:CPU
    sorts a lone integer array several times faster than the (row, position) pair ``jnp.unique``
    sorts), on the host numpy's stable argsort of the rows (the same order).
    Returns (order: the positions by (row, position), segment: each sorted position's touched
    row index, unique [E]: the touched rows ascending then distinct out-of-range rows). ``xp``:
    ``jnp`` (in a program) or ``np`` (on the host, several times faster than XLA:CPU's sort)."""
    entries = phys.shape[0]
    position = xp.arange(entries, dtype=xp.int32)
    if xp is np:  # a stable sort of the rows: numpy's merges the buffers' sorted runs in linear time
        order = np.argsort(phys, kind="stable").astype(np.int32)
        row = phys[order].astype(np.int32)
    else:
        if (stack_rows + 1) * entries < 2**31:
            dtype = xp.int32
        elif jax.config.jax_enable_x64:
            dtype = xp.int64
        else:
            return None
        keys = xp.sort(phys.astype(dtype) * entries + position.astype(dtype))
        row = (keys // entries).astype(xp.int32)
        order = (keys % entries).astype(xp.int32)
    segment = xp.cumsum(first_of_runs(row, xp), dtype=xp.int32) - 1
    # every position of one segment writes the same row; padding's segment an out-of-range one
    rows = xp.where(row < stack_rows, row, stack_rows + segment)
    if xp is np:
        unique = stack_rows + position
        unique[segment] = rows
    else:
        unique = (stack_rows + position).at[segment].set(rows)
    return order, segment, unique


def touched_rows(phys, stack_rows: int, xp=jnp):
    """The deduplication :func:`fused_update` does for buffers whose :func:`decode` gave ``phys``,
    to compute ahead (e.g. on the host with ``xp=np`` while the previous step runs) and hand to it
    and to the lookup: one int32 vector, order [E], segment [E] and unique [E]
    (:func:`_touched_rows`) end to end; None where the keys need 64 bits and x64 is off (the
    update then deduplicates itself). :func:`fit_touched` cuts it."""
    dedup = _touched_rows(phys, stack_rows, xp)
    return None if dedup is None else xp.concatenate(dedup).astype(xp.int32)


def fit_touched(touched: np.ndarray, entries: int, unique: int | None = None) -> np.ndarray:
    """:func:`touched_rows` (a host array) with ``unique`` cut to ``unique`` rows (default: the
    :func:`unique_bucket` of the :func:`touched_count`; at least that many): the update and the
    lookup then read and write that many table rows instead of one per buffer entry."""
    unique = unique_bucket(touched_count(touched, entries), entries) if unique is None else unique
    return touched[:2 * entries + unique]


def touched_count(touched: np.ndarray, entries: int) -> int:
    """The segments (distinct rows, padding's included) the ``entries`` buffer entries of a
    :func:`touched_rows` vector use (its other unique slots are distinct out-of-range rows)."""
    return int(touched[2 * entries - 1]) + 1  # the last sorted position's segment


def unique_bucket(count: int, entries: int, buckets: Buckets = DEFAULT_BUCKETS) -> int:
    """The unique rows kept for ``count`` used segments: its bucket of ``buckets``, at most
    ``entries``."""
    return min(entries, buckets.rows(count))


def split_touched(touched, entries: int):
    """(order [E], segment [E], unique [U]) of a :func:`touched_rows` vector (cut or not)."""
    if touched.ndim != 1 or not 2 * entries < touched.shape[0] <= 3 * entries:
        raise ValueError(f"touched_rows must be a vector of order, segment ({entries} each) and 1 to {entries} "
                         f"unique rows (touched_rows() of these buffers), got shape {list(touched.shape)}")
    return touched[:entries], touched[entries:2 * entries], touched[2 * entries:]


def fused_update(optimizer: str, row_pointers, embedding_ids, sample_ids, gains, embedding_table, slots,
                 activations_grad, hypers, devices: int = 1, device_index: int = 0, touched=None, grad_rows=None,
                 minibatches: int = 1):
    """The fused backward + ``optimizer`` update (its rule's, ``sparsecore.optimizer_rules``, by
    name) on the rows the batch touches only: per touched row, g = the sum of gain * activation
    gradient over its entries (in buffer order for each row, as :func:`table_grad` sums), then the rule's update
    of those rows and their slots, scattered back. The work is O(entries * dim), not O(table rows *
    dim) as a dense gradient; the touched rows equal the rule's update of :func:`table_grad`'s. ``touched``: the
    :func:`touched_rows` of the same buffers and table, computed ahead (else deduplicated here).
    ``grad_rows`` [device_batch_size]: the row of ``activations_grad`` (then any [R, dim], e.g. the
    gradient of a whole layer's output whose rows interleave several stacks) that holds each
    activation row's gradient; the update reads those rows alone, where permuting the gradient
    into activation order first would copy all of it. ``minibatches``: see :func:`decode`. Returns the
    new table (and slots)."""
    device_batch_size = activations_grad.shape[0] if grad_rows is None else grad_rows.shape[0]
    entries = csr_entries(row_pointers, embedding_ids, sample_ids, gains, embedding_table.shape[0],
                          device_batch_size, devices, device_index, touched, relabel=grad_rows,
                          relabelled_rows=activations_grad.shape[0], minibatches=minibatches)
    activations_grad = activations_grad.astype(jnp.float32)

    def read(rows):
        return activations_grad.at[rows].get(mode="fill", fill_value=0.0)

    out = update(entries, embedding_table, slots, read, rule_named(optimizer), hypers, activations_grad.shape[1])
    return out if len(out) > 1 else out[0]
