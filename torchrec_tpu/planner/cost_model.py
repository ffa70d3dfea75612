"""SparseCore-aware storage and step-time estimates for one table under one sharding.

Notation: D devices (JAX devices: chips on v5p/v6e, chiplets on tpu7x), S SparseCores per device,
N = D*S, global batch B, local batch b = B/D; a table has R rows, dim d, F features with pooling
factor P (mean ids per sample per feature); ids per step I = B*P*F, per device I/D. d' = ceil8(d)
(SparseCore alignment). Parameters are float32 (4 B); a row with optimizer state takes
``row_bytes(w) = 4*w*(1 + slots_per_element) + 4*slots_per_row`` (``tpu_facts.OPTIMIZER_SLOTS``);
a table held at another ``data_type`` (inference) counts its rows at that dtype instead
(:func:`stored_row_bytes`: fp16 / bf16 2 B an element, int8 / int4 packed codes and a 4 B fp16
scale and bias per row, fp16 / int8 / int4 rows padded to 16 B, as FBGEMM's inference TBE stores them).
Ids travel as CSR triplets (id, sample, gain) = 12 B. ``bw_sc`` = device HBM bandwidth x
``sparsecore_hbm_efficiency``; ``t_u`` / ``t_h`` = seconds per byte of a uniform all-to-all / of
traffic into one device (``torchrec_tpu.topology``).

Row-wise (mod over all N SparseCores, the jax-tpu-embedding layout): rows padded to a multiple of
8N, each device holds R'/D rows. Lookup time ``(I/D) * (4d' + 2*row_bytes(d')) / bw_sc``
(forward gather, backward read-modify-write of row and slots; no dedup assumed). Each sample's
ids reach at most min(P, N) SparseCores per feature, each returning a partial sum, so the
all-to-all sends ``(1-1/D) * (12*I/D + 2*b*F*min(P,N)*4d')`` bytes per device (ids, activations
forward, gradients backward), costed at ``t_u``.

Table-wise on device k: rows padded to 8S (mod over k's SparseCores). Device k does all I lookups
and receives/sends ``(D-1) * (12*I/D + b*F*4d')`` bytes (costed at ``t_h``: its own links are the
bottleneck); every device sends its ids and receives/sends activations: ``12*I/D + 2*b*F*4d'``
at ``t_u``. Column-wise into c shards of width d'/c (a multiple of 8) is c table-wise shards.

Data-parallel, priced as the runtime runs it (``torchrec_tpu.sharding``): the whole table and its
slots on every device (rows padded to 8S), and every replica applies the same fused update on the
global batch, so no all-reduce: each device sends its ids to every other replica and every replica
looks up (and updates) all I ids, returning each device's pooled rows and receiving their
gradients: ``(D-1) * (12*I/D + 2*b*F*4d')`` bytes per device at ``t_u``.

Every sharding also charges each device its output activation buffers (``2*b*F*4d'``: pooled
output and its gradient), and all-to-all receive buffers count as activation memory. The id limit
is checked per (source SparseCore, destination SparseCore) partition:
``skew * (b/S) * P * F / N`` ids row-wise, ``skew * (b/S) * P * F / S`` table-wise; over
``max_ids_per_partition`` the device would abort (LOG(FATAL)), so such options are rejected.
Per-device step time = lookups + all-to-all + ``kernel_overhead_s`` per stacked table
+ ``collective_latency_s`` per collective (3 all-to-alls).
Compute and communication are assumed not to overlap (conservative).
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

from torchrec_tpu.planner.tables import (
    DATA_TYPE_BITS,
    SCALE_BIAS_BYTES,
    TBE_PADDED_DTYPES,
    TBE_ROW_ALIGNMENT,
    EmbeddingTable,
)
from torchrec_tpu.topology import TPUTopology
from tpu_facts import ALIGNMENT, DEFAULT_MAX_IDS_PER_PARTITION, OPTIMIZER_SLOTS, ShardingKind, round_up

PARAM_BYTES = 4
ACTIVATION_BYTES = 4
CSR_BYTES_PER_ID = 12
ALL_TO_ALLS_PER_STEP = 3  # ids, activations forward, gradients backward


@dataclass(frozen=True)
class Load:
    """What an option costs one device: memory (bytes) and time (seconds) per training step."""

    hbm_bytes: float = 0.0  # parameters + optimizer slots
    buffer_bytes: float = 0.0  # activations and all-to-all receive buffers
    lookup_s: float = 0.0
    comm_s: float = 0.0
    input_bytes: float = 0.0  # ids (CSR) the device's SparseCores look up per step
    output_bytes: float = 0.0  # pooled rows (or partial sums) it returns per step

    @property
    def memory_bytes(self) -> float:
        return self.hbm_bytes + self.buffer_bytes

    @property
    def time_s(self) -> float:
        return self.lookup_s + self.comm_s

    def __add__(self, other: Load) -> Load:
        return Load(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def scaled(self, k: float) -> Load:
        """Every quantity times ``k``."""
        return Load(*(k * a for a in astuple(self)))


@dataclass(frozen=True)
class ShardCost:
    """One column block placed on a single device (table-wise: the whole width)."""

    column_offset: int
    columns: int
    rows: int  # padded rows the device holds
    load: Load


@dataclass(frozen=True)
class ShardingOption:
    """A table under one sharding: ``uniform`` lands on every device, each of ``shards`` on one."""

    table: EmbeddingTable
    kind: ShardingKind
    uniform: Load
    shards: tuple[ShardCost, ...]
    rows_per_device: int  # row-wise / data-parallel rows on every device; 0 when placed
    padded_dim: int
    ids_per_partition: float

    def total_time_s(self, num_devices: int) -> float:
        return self.uniform.time_s * num_devices + sum(s.load.time_s for s in self.shards)

    @property
    def max_shard_time_s(self) -> float:
        return max((s.load.time_s for s in self.shards), default=0.0)

    @property
    def stack_key(self) -> str:
        """Tables sharing this key (and device, when placed) stack into one SparseCore table."""
        width = self.shards[0].columns if self.shards else self.padded_dim
        return f"{self.kind.value}/d{width}/{self.table.optimizer}/{self.table.combiner}"


def row_bytes(table: EmbeddingTable, width: int) -> int:
    per_element, per_row = (len(slots) for slots in OPTIMIZER_SLOTS[table.optimizer])
    return stored_row_bytes(width, table.data_type) + PARAM_BYTES * width * per_element + PARAM_BYTES * per_row


def stored_row_bytes(width: int, data_type: str) -> int:
    """Bytes of one ``width``-wide row at ``data_type`` as the host holds it: its elements, for the
    row-wise quantized dtypes (int8, int4: packed codes) FBGEMM's per-row fp16 scale and bias, and
    in FBGEMM's inference TBE (fp16, int8, int4) padded to its row alignment."""
    bits = DATA_TYPE_BITS[data_type]
    row = math.ceil(width * bits / 8) + (SCALE_BIAS_BYTES if bits < 16 else 0)
    return round_up(row, TBE_ROW_ALIGNMENT) if data_type in TBE_PADDED_DTYPES else row


class OptionBuilder:
    """Builds the sharding options of tables for one topology and global batch size."""

    def __init__(self, topology: TPUTopology, batch_size: int,
                 max_ids_per_partition: int = DEFAULT_MAX_IDS_PER_PARTITION) -> None:
        if not topology.sparsecores_per_device:
            raise ValueError(f"{topology.name}: {topology.chip.name} has no SparseCore that jax-tpu-embedding "
                             "drives, and this planner places tables on SparseCore lookups only; plan on v5p, "
                             "v6e or tpu7x")
        if batch_size < 1:
            raise ValueError(f"global batch (--batch-size) must be >= 1, got {batch_size}")
        if batch_size % topology.num_devices:
            raise ValueError(
                f"global batch (--batch-size) {batch_size} must divide evenly over {topology.num_devices} devices of "
                f"{topology.name}"
            )
        if max_ids_per_partition < 1:
            raise ValueError(f"max_ids_per_partition must be >= 1, got {max_ids_per_partition}")
        self.topology = topology
        self.batch_size = batch_size
        self.max_ids_per_partition = max_ids_per_partition
        self.d = topology.num_devices
        self.s = topology.sparsecores_per_device
        self.n = topology.num_sparsecores
        self.local_batch = batch_size / self.d
        self.bw_sc = topology.sparsecore_bandwidth_per_device
        self.t_u = topology.uniform_seconds_per_byte
        self.t_h = topology.hotspot_seconds_per_byte

    def _ids_per_device(self, t: EmbeddingTable) -> float:
        return self.batch_size * t.ids_per_sample / self.d

    def _partition_ids(self, t: EmbeddingTable, destinations: int) -> float:
        per_source_sc = self.local_batch / self.s * t.ids_per_sample
        return self.topology.costs.skew * per_source_sc / destinations

    def _output_buffers(self, t: EmbeddingTable, width: int) -> float:
        return 2 * self.local_batch * t.num_features * ACTIVATION_BYTES * width

    def _lookup_seconds(self, t: EmbeddingTable, ids: float, width: int) -> float:
        return ids * (PARAM_BYTES * width + 2 * row_bytes(t, width)) / self.bw_sc

    def row_wise(self, t: EmbeddingTable) -> ShardingOption:
        dp = round_up(t.dim, ALIGNMENT)
        shard_rows = round_up(t.rows, ALIGNMENT * self.n) // self.d
        ids = self._ids_per_device(t)
        partials = min(t.pooling_factor, self.n)
        sent = (1 - 1 / self.d) * (CSR_BYTES_PER_ID * ids
                                   + 2 * self.local_batch * t.num_features * partials * ACTIVATION_BYTES * dp)
        uniform = Load(hbm_bytes=shard_rows * row_bytes(t, dp), buffer_bytes=sent + self._output_buffers(t, dp),
                       lookup_s=self._lookup_seconds(t, ids, dp), comm_s=sent * self.t_u,
                       input_bytes=CSR_BYTES_PER_ID * ids,
                       output_bytes=self.local_batch * t.num_features * partials * ACTIVATION_BYTES * dp)
        return ShardingOption(t, ShardingKind.ROW_WISE, uniform, (), shard_rows, dp, self._partition_ids(t, self.n))

    def column_wise(self, t: EmbeddingTable, num_shards: int) -> ShardingOption:
        """``num_shards`` equal blocks of the padded dim; ``num_shards`` == 1 is table-wise."""
        dp = round_up(t.dim, ALIGNMENT)
        width = dp // num_shards
        if width * num_shards != dp or width % ALIGNMENT:
            raise ValueError(f"table {t.name!r}: padded dim {dp} does not split into {num_shards} blocks of 8k")
        return self.column_blocks(t, [width] * num_shards)

    def column_blocks(self, t: EmbeddingTable, widths: list[int]) -> ShardingOption:
        """Column blocks of the given widths (each padded to 8), each on one device."""
        shard_rows = round_up(t.rows, ALIGNMENT * self.s)
        ids = self._ids_per_device(t)
        shards, uniform, offset = [], Load(), 0
        for raw in widths:
            width = round_up(raw, ALIGNMENT)
            act = self.local_batch * t.num_features * ACTIVATION_BYTES * width
            per_device = CSR_BYTES_PER_ID * ids + 2 * act
            owner_bytes = (self.d - 1) * (CSR_BYTES_PER_ID * ids + act)
            owner = Load(hbm_bytes=shard_rows * row_bytes(t, width), buffer_bytes=owner_bytes,
                         lookup_s=self._lookup_seconds(t, ids * self.d, width), comm_s=owner_bytes * self.t_h,
                         input_bytes=CSR_BYTES_PER_ID * ids * self.d, output_bytes=act * self.d)
            shards.append(ShardCost(offset, width, shard_rows, owner))
            uniform = uniform + Load(buffer_bytes=per_device + self._output_buffers(t, width),
                                     comm_s=per_device * self.t_u if self.d > 1 else 0.0)
            offset += width
        kind = ShardingKind.TABLE_WISE if len(widths) == 1 else ShardingKind.COLUMN_WISE
        return ShardingOption(t, kind, uniform, tuple(shards), 0, offset, self._partition_ids(t, self.s))

    def data_parallel(self, t: EmbeddingTable) -> ShardingOption:
        dp = round_up(t.dim, ALIGNMENT)
        shard_rows = round_up(t.rows, ALIGNMENT * self.s)
        ids = self._ids_per_device(t)
        act = self.local_batch * t.num_features * ACTIVATION_BYTES * dp
        sent = (self.d - 1) * (CSR_BYTES_PER_ID * ids + 2 * act)
        uniform = Load(hbm_bytes=shard_rows * row_bytes(t, dp), buffer_bytes=sent + self._output_buffers(t, dp),
                       lookup_s=self._lookup_seconds(t, ids * self.d, dp), comm_s=sent * self.t_u,
                       input_bytes=CSR_BYTES_PER_ID * ids * self.d, output_bytes=act * self.d)
        return ShardingOption(t, ShardingKind.DATA_PARALLEL, uniform, (), shard_rows, dp,
                              self._partition_ids(t, self.s))

    def column_split_counts(self, t: EmbeddingTable) -> list[int]:
        """Column-wise shard counts: powers of two up to D whose blocks are multiples of 8."""
        blocks = round_up(t.dim, ALIGNMENT) // ALIGNMENT
        counts = (2**k for k in range(1, int(math.log2(blocks)) + 1))
        # every block must hold real (unpadded) columns
        return [c for c in counts if blocks % c == 0 and c <= self.d and (c - 1) * (blocks // c) * ALIGNMENT < t.dim]

    def options(self, t: EmbeddingTable) -> list[ShardingOption]:
        """Every sharding of ``t`` this topology supports (feasibility is checked by the caller)."""
        out = [self.row_wise(t), self.column_wise(t, 1)]
        out += [self.column_wise(t, c) for c in self.column_split_counts(t)]
        out.append(self.data_parallel(t))
        return out
