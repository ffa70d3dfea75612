"""Host side of the ``xla`` backend: a stack's entries (those its CSR buffers hold, in row order)
as the core's record (``sparsecore.entries``), every touched row once, padded to one of a few sizes
so that few programs get compiled, and the gather strategy's slots where it pays.

Entry order matters for float32 sums: inside a sample the entries keep the CSR order and inside
a row the order of the source SparseCores, so the device sums exactly as the SparseCores do.
"""

from __future__ import annotations

import numpy as np

from sparsecore import native
from sparsecore.csr_format import RowOrderedEntries
from sparsecore.entries import DEFAULT_BUCKETS, Buckets, GatherSlots, PackedEntries, pack_row_ordered
from sparsecore.preprocess import ENGINES


def stack_input(entries: RowOrderedEntries, stack_rows: int, activation_rows: np.ndarray,
                buckets: Buckets = DEFAULT_BUCKETS) -> tuple[PackedEntries, GatherSlots | None]:
    """A stack's device input: its entries (rows deduplicated, padded to ``buckets``) with their
    samples relabelled by ``activation_rows``, and the gather strategy of the lookup when it is at
    most twice the work (few ids per sample, e.g. one-hot features)."""
    sample = activation_rows[entries.sample]
    packed = pack_row_ordered(entries.phys, sample, entries.gain, stack_rows, buckets)
    counts = np.bincount(sample, minlength=activation_rows.size)
    most = int(counts.max(initial=0))
    slots = buckets.slots(most)
    if slots * activation_rows.size > 2 * packed.gains.shape[0]:
        return packed, None
    slot_rows = np.full((slots, activation_rows.size), stack_rows, dtype=np.int32)
    slot_gains = np.zeros((slots, activation_rows.size), dtype=np.float32)
    if most <= 1:
        slot_rows[0, sample] = entries.phys
        slot_gains[0, sample] = entries.gain
    else:
        fill_slots(sample, entries.phys, entries.gain, counts, slot_rows, slot_gains)
    return packed, GatherSlots(slot_rows, slot_gains)


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
