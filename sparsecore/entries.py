"""The one SparseCore core: a stack's batch as an :class:`Entries` record, its pooled lookup
(:func:`lookup`) and the fused optimizer update of the rows it touches (:func:`update`), in
``jax.numpy``.

Two producers make the record: the ``xla`` backend's host preprocessing, entries in row order
(:func:`pack_row_ordered`, shipped as :class:`PackedEntries`), and the ``tpu::`` ops' decode of CSR
buffers (``sparsecore.csr_math.csr_entries``). Both list each entry's touched row, activation row
and gain in the order the SparseCores sum them (by physical row, then source SparseCore, then
sample), so every consumer adds the same float32 terms in the same order. On a TPU the ops run
jax-tpu-embedding's kernels instead (``sparsecore.csr_kernels``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsecore.optimizer_rules import OptimizerRule
from sparsecore.table_rows import scatter_rows
from tpu_facts import eighth_bucket, power_of_two_bucket, quarter_bucket

Bucket = Callable[[int], int]  # a size -> the padded size programs are compiled for


@dataclass(frozen=True)
class Buckets:
    """The padding policy of the core's inputs, a parameter of both producers: the size a batch
    needs, rounded up to one of the few sizes programs are compiled for. ``entries``: a host-made
    record's entries; ``rows``: touched rows (both producers); ``partition``: ids per partition of
    cut CSR buffers (then 8-aligned, ``sparsecore.csr_sizes``); ``slots``: the gather strategy's
    slots per activation row."""

    entries: Bucket = quarter_bucket
    rows: Bucket = quarter_bucket
    partition: Bucket = eighth_bucket
    slots: Bucket = power_of_two_bucket


DEFAULT_BUCKETS = Buckets()


@dataclass(frozen=True)
class Entries:
    """One stack's batch: ``rows`` [U] the physical rows read (``deduplicated``: every touched row
    once, ascending, then distinct out-of-range padding rows; else one per entry), ``segment`` [E]
    each entry's index into ``rows`` (None: entry i reads ``rows[i]``; non-decreasing when
    ``deduplicated``), ``activation`` [E] each entry's activation row (out of range, or with gain 0:
    adds nothing) and ``gain`` [E]."""

    rows: Any
    segment: Any
    activation: Any
    gain: Any
    deduplicated: bool = True

    @property
    def touched(self) -> int:
        return self.rows.shape[0]

    def _hints(self) -> dict[str, bool]:
        return dict(indices_are_sorted=True, unique_indices=True) if self.deduplicated else {}


jax.tree_util.register_dataclass(Entries, data_fields=["rows", "segment", "activation", "gain"],
                                 meta_fields=["deduplicated"])


@dataclass(frozen=True)
class PackedEntries:
    """Deduplicated :class:`Entries` made on the host, in two arrays (fewer transfers): ``ints``
    holds rows [u], segment [e] and activation rows [e]; ``gains`` [e]."""

    ints: np.ndarray | jax.Array  # int32 [u + 2e]
    gains: np.ndarray | jax.Array  # float32 [e]

    def unpack(self) -> Entries:
        e = self.gains.shape[0]
        u = self.ints.shape[0] - 2 * e
        return Entries(self.ints[:u], self.ints[u:u + e], self.ints[u + e:], self.gains)


jax.tree_util.register_dataclass(PackedEntries, data_fields=["ints", "gains"], meta_fields=[])


@dataclass(frozen=True)
class GatherSlots:
    """The gather strategy of :func:`lookup`, made on the host from the same entries: slot k of
    activation row r holds r's k-th entry (physical row, gain); empty slots read an out-of-range
    row with gain 0. A few gathers instead of a scatter-add: faster for few ids per sample."""

    rows: np.ndarray | jax.Array  # int32 [slots, activation rows]
    gains: np.ndarray | jax.Array  # float32 [slots, activation rows]


jax.tree_util.register_dataclass(GatherSlots, data_fields=["rows", "gains"], meta_fields=[])


def first_of_runs(sorted_rows, xp=jnp):
    """Whether each of ``sorted_rows`` starts a run of equal rows (the deduplication of rows in
    order; ``xp``: ``jnp`` or ``np``)."""
    return xp.concatenate([xp.ones((1,), bool), sorted_rows[1:] != sorted_rows[:-1]])


def pack_row_ordered(phys: np.ndarray, activation: np.ndarray, gain: np.ndarray, stack_rows: int,
                     buckets: Buckets = DEFAULT_BUCKETS) -> PackedEntries:
    """The host producer: entries sorted by physical row ``phys`` (of a stack of ``stack_rows``),
    rows deduplicated, touched rows and entries each padded to their bucket of ``buckets`` (apart:
    rows are often a third of the entries; both barely move between batches of one data set, so
    few programs get compiled). Padding entries add 0 to
    activation row 0 and read a padding row; padding rows are distinct and out of range."""
    first = first_of_runs(phys, np)
    touched = phys[first]
    u, e = buckets.rows(touched.size + 1), buckets.entries(phys.size + 1)  # at least one padding row
    ints = np.empty(u + 2 * e, dtype=np.int32)
    ints[: touched.size] = touched
    ints[touched.size: u] = stack_rows + np.arange(u - touched.size)
    ints[u: u + phys.size] = np.cumsum(first) - 1
    ints[u + phys.size: u + e] = touched.size
    ints[u + e: u + e + phys.size] = activation
    ints[u + e + phys.size:] = 0
    gains = np.zeros(e, dtype=np.float32)
    gains[: phys.size] = gain
    return PackedEntries(ints, gains)


def lookup(entries: Entries, table: jax.Array, activation_rows: int, strategy: GatherSlots | None = None
           ) -> jax.Array:
    """Pooled activations [activation_rows, dim]: per activation row, the sum of gain * table row
    over its entries, in entry order. ``strategy``: None sums the entries with a segment sum
    (every touched row read once where ``deduplicated``); :class:`GatherSlots` adds the slots
    slot by slot instead (for every activation row the same float32 additions in the same order;
    a loop, as XLA may reorder a chain of adds)."""
    if strategy is not None:
        terms = strategy.gains[:, :, None] * table.at[strategy.rows].get(mode="fill", fill_value=0.0)
        return jax.lax.fori_loop(1, terms.shape[0], lambda k, total: total + terms[k], terms[0])
    values = table.at[entries.rows].get(mode="fill", fill_value=0.0, **entries._hints())
    if entries.segment is not None:
        values = values[entries.segment]
    pooled = jax.ops.segment_sum(entries.gain[:, None] * values, entries.activation, num_segments=activation_rows)
    return pooled.astype(table.dtype)


def dense_grad(entries: Entries, activation_grad: Callable[[Any], Any], stack_rows: int) -> tuple[jax.Array, jax.Array]:
    """The lookup's gradient as a dense table [stack_rows, dim], and which rows its entries touch
    [stack_rows] bool: per row, the sum of gain * activation gradient over its entries in entry
    order (``activation_grad`` as in :func:`update`); rows past the table (padding) are dropped."""
    rows = entries.rows if entries.segment is None else entries.rows[entries.segment]
    contributions = entries.gain[:, None] * activation_grad(entries.activation)
    grad = jax.ops.segment_sum(contributions, rows, num_segments=stack_rows)
    touched = jax.ops.segment_sum(jnp.ones(rows.shape, jnp.int32), rows, num_segments=stack_rows) > 0
    return grad, touched


def update(entries: Entries, table: jax.Array, slots: Sequence[jax.Array], activation_grad: Callable[[Any], Any],
           rule: OptimizerRule, hypers: Sequence[Any], row_dims: Any) -> tuple[jax.Array, ...]:
    """The fused backward + ``rule``'s update (with its op's ``hypers``) of the rows ``entries``
    touch, and of their ``slots`` (in the op's order): per touched row, g = the sum of gain *
    activation gradient over its entries in entry order, then the rule's update of that row,
    written back in place (``sparsecore.table_rows``); other rows stay as they are.
    ``activation_grad(rows)``: the gradient of those activation rows. ``row_dims``: each row's
    logical dim, one number or a vector over the table's rows. Returns (table, *slots)."""
    contributions = entries.gain[:, None] * activation_grad(entries.activation)
    grad = jax.ops.segment_sum(contributions, entries.segment, num_segments=entries.touched,
                               indices_are_sorted=entries.deduplicated)
    old = [table, *slots]
    hints = entries._hints()
    # rows past the table (padding) are read as 0 and their updates dropped
    row_values, *slot_values = [t.at[entries.rows].get(mode="fill", fill_value=0.0, **hints) for t in old]
    if jnp.ndim(row_dims):
        row_dims = jnp.maximum(row_dims.at[entries.rows].get(mode="fill", fill_value=1, **hints), 1)
    new_rows, new_slots = rule.update(row_values, tuple(slot_values), grad, hypers, row_dims)
    return tuple(scatter_rows(t, entries.rows, n.astype(t.dtype), entries.deduplicated)
                 for t, n in zip(old, (new_rows, *new_slots)))
