"""Host side of the ``xla`` backend: a stack's CSR buffers reduced to the entries the SparseCores
would read, deduplicated by row and padded to one of a few sizes (so few programs get compiled).

Only the used part of the buffers is read: partition p of source SparseCore k holds the entries
[round_up(end[p-1], 8), end[p]) of k's region, in the order the SparseCores read them; the
device then touches each row once (``rows``) and sums every entry into its sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsecore.preprocess import ALIGN, StackCSR, coo_buffer_size_per_device, row_pointers_per_sc
from sparsecore.stacking import StackedTable

MIN_BUCKET = 64


@dataclass(frozen=True)
class StackGeometry:
    """Static layout of one stack's CSR buffers."""

    chunks: int  # source SparseCores (devices x SCs per device)
    n: int  # destination SparseCores
    width: int  # row pointers per source SparseCore
    region: int  # COO entries per source SparseCore
    rows: int  # physical rows of the stacked table
    shard_rows: int
    samples_per_chunk: int

    @classmethod
    def of(cls, stack: StackedTable, devices: int, sparsecores_per_device: int) -> StackGeometry:
        chunks = devices * sparsecores_per_device
        return cls(chunks, stack.num_sparsecores, row_pointers_per_sc(stack),
                   coo_buffer_size_per_device(stack, sparsecores_per_device) // sparsecores_per_device,
                   stack.vocab_size, stack.shard_rows, stack.total_sample_count // chunks)

    @property
    def samples(self) -> int:
        return self.chunks * self.samples_per_chunk


@dataclass(frozen=True)
class StackEntries:
    """One stack's lookup work: every kept entry once, in the SparseCores' reading order."""

    rows: np.ndarray  # int32 [bucket > touched]: touched physical rows ascending, then `geo.rows` (out of range)
    inverse: np.ndarray  # int32 [bucket]: each entry's index into ``rows``; padding entries -> a padding row
    samples: np.ndarray  # int32 [bucket]: each entry's row of the stack's activations (chunk-major)
    gains: np.ndarray  # float32 [bucket]: 0 on padding entries

    @property
    def shapes(self) -> tuple[int, int]:
        return self.rows.size, self.samples.size


def bucket(n: int) -> int:
    """``n`` rounded up to one of four sizes per power of two (at most 25% padding)."""
    if n <= MIN_BUCKET:
        return MIN_BUCKET
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def stack_entries(geo: StackGeometry, csr: StackCSR) -> StackEntries:
    """The valid entries of ``csr``: (physical row, activation row, gain), rows deduplicated."""
    ends = csr.row_pointers.reshape(geo.chunks, geo.width)[:, : geo.n].astype(np.int64)
    starts = np.zeros_like(ends)
    starts[:, 1:] = -(-ends[:, :-1] // ALIGN) * ALIGN
    counts = (ends - starts).reshape(-1)
    first = (np.arange(geo.chunks)[:, None] * geo.region + starts).reshape(-1)
    total = int(counts.sum())
    partition = np.repeat(np.arange(counts.size), counts)
    position = np.arange(total) - np.repeat(np.cumsum(counts) - counts - first, counts)
    phys = (partition % geo.n) * geo.shard_rows + csr.embedding_ids[position]
    sample = (partition // geo.n) * geo.samples_per_chunk + csr.sample_ids[position]
    rows, inverse = np.unique(phys, return_inverse=True)
    return _padded(geo, rows, inverse, sample, csr.gains[position])


def _padded(geo: StackGeometry, rows, inverse, sample, gain) -> StackEntries:
    """Pad to bucket sizes; padding entries add 0 to sample 0 and update a padding row, which the
    device reads as zeros and never writes (``rows`` keeps at least one padding row)."""
    u, e = bucket(rows.size + 1), bucket(sample.size)
    out_rows = np.full(u, geo.rows, dtype=np.int32)
    out_rows[: rows.size] = rows
    out_inverse = np.full(e, rows.size, dtype=np.int32)
    out_inverse[: inverse.size] = inverse.reshape(-1)
    out_sample = np.zeros(e, dtype=np.int32)
    out_sample[: sample.size] = sample
    out_gain = np.zeros(e, dtype=np.float32)
    out_gain[: gain.size] = gain
    return StackEntries(out_rows, out_inverse, out_sample, out_gain)
