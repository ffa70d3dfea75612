"""Host side of the ``xla`` backend: a stack's entries (those its CSR buffers hold, in row order)
with every touched row once, padded to one of a few sizes so that few programs get compiled.

Entry order matters for float32 sums: inside a sample the entries keep the CSR order and inside
a row the order of the source SparseCores, so the device sums exactly as the SparseCores do.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from sparsecore import native
from sparsecore.csr_format import RowOrderedEntries
from sparsecore.preprocess import ENGINES
from tpu_facts import power_of_two_bucket, quarter_bucket


@dataclass(frozen=True)
class StackEntries:
    """One stack's lookup work, packed into two arrays (few transfers): ``ints`` holds the touched
    physical rows ascending then out-of-range padding rows [u], each entry's index into them [e]
    and each entry's activation row [e]; ``gains`` [e] is 0 on padding entries."""

    ints: np.ndarray | jax.Array  # int32 [u + 2e]
    gains: np.ndarray | jax.Array  # float32 [e]

    @property
    def entries(self) -> int:
        return self.gains.shape[0]

    @property
    def touched(self) -> int:
        return self.ints.shape[0] - 2 * self.entries

    @property
    def rows(self):
        return self.ints[: self.touched]

    @property
    def inverse(self):
        return self.ints[self.touched: self.touched + self.entries]

    @property
    def samples(self):
        return self.ints[self.touched + self.entries:]


jax.tree_util.register_dataclass(StackEntries, data_fields=["ints", "gains"], meta_fields=[])


@dataclass(frozen=True)
class SlotForward:
    """The forward as a few gathers instead of a scatter-add: slot k of activation row r holds
    r's k-th entry (physical row, gain); empty slots read an out-of-range row with gain 0."""

    rows: np.ndarray | jax.Array  # int32 [slots, activation rows]
    gains: np.ndarray | jax.Array  # float32 [slots, activation rows]


jax.tree_util.register_dataclass(SlotForward, data_fields=["rows", "gains"], meta_fields=[])


def stack_input(entries: RowOrderedEntries, stack_rows: int, activation_rows: np.ndarray,
                ) -> tuple[StackEntries, SlotForward | None]:
    """A stack's device input: its entries (rows deduplicated) with their samples relabelled by
    ``activation_rows``, and the slot form of the forward when it is at most twice the work
    (few ids per sample, e.g. one-hot features)."""
    sample = activation_rows[entries.sample]
    packed = stack_entries(RowOrderedEntries(entries.phys, sample, entries.gain, entries.stats), stack_rows)
    counts = np.bincount(sample, minlength=activation_rows.size)
    most = int(counts.max(initial=0))
    slots = power_of_two_bucket(most)
    if slots * activation_rows.size > 2 * packed.entries:
        return packed, None
    slot_rows = np.full((slots, activation_rows.size), stack_rows, dtype=np.int32)
    slot_gains = np.zeros((slots, activation_rows.size), dtype=np.float32)
    if most <= 1:
        slot_rows[0, sample] = entries.phys
        slot_gains[0, sample] = entries.gain
    else:
        fill_slots(sample, entries.phys, entries.gain, counts, slot_rows, slot_gains)
    return packed, SlotForward(slot_rows, slot_gains)


def fill_slots(sample: np.ndarray, phys: np.ndarray, gain: np.ndarray, counts: np.ndarray, slot_rows: np.ndarray,
               slot_gains: np.ndarray, engine: str = "auto") -> None:
    """Slot k of activation row r := the k-th entry (in entry order) of sample r; ``counts`` are
    the entries per sample. Compiled when the extension is available (``engine`` as in
    ``sparsecore.preprocess``), else numpy."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    ext = None if engine == "numpy" else native.require_extension() if engine == "compiled" else native.extension()
    if ext is not None:
        ext.fill_slots(np.ascontiguousarray(sample, dtype=np.int64), np.ascontiguousarray(phys, dtype=np.int64),
                       np.ascontiguousarray(gain, dtype=np.float32), slot_rows.shape[0], slot_rows.reshape(-1),
                       slot_gains.reshape(-1))
        return
    order = np.argsort(sample, kind="stable")
    rank = np.arange(sample.size) - np.repeat(np.cumsum(counts) - counts, counts)
    slot_rows[rank, sample[order]] = phys[order]
    slot_gains[rank, sample[order]] = gain[order]


def stack_entries(entries: RowOrderedEntries, stack_rows: int) -> StackEntries:
    """Deduplicate the rows of ``entries`` (a stack of ``stack_rows`` physical rows) and pad: padding
    entries add 0 to sample 0 and belong to a padding row, which the device reads as zeros and
    never writes (there is always one; padding rows are distinct, so row indices stay unique)."""
    phys = entries.phys
    first = np.ones(phys.size, dtype=bool)
    first[1:] = phys[1:] != phys[:-1]
    touched = phys[first]
    # touched rows and entries bucketed apart (rows are often a third of the entries: the row
    # gathers, the optimizer and the scatters do that much less padding); both barely move
    # between batches of one data set, so few programs get compiled
    u, e = quarter_bucket(touched.size + 1), quarter_bucket(phys.size + 1)
    ints = np.empty(u + 2 * e, dtype=np.int32)
    ints[: touched.size] = touched
    ints[touched.size: u] = stack_rows + np.arange(u - touched.size)
    ints[u: u + phys.size] = np.cumsum(first) - 1
    ints[u + phys.size: u + e] = touched.size
    ints[u + e: u + e + phys.size] = entries.sample
    ints[u + e + phys.size:] = 0
    gains = np.zeros(e, dtype=np.float32)
    gains[: phys.size] = entries.gain
    return StackEntries(ints, gains)
