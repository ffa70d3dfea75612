"""Table, feature and SparseCore-topology specs, validated on construction.

These are the single description of embedding tables in the project: the planner, the sharded
EBC and every backend consume them (``sparsecore.torchrec_convert`` maps them from/to TorchRec's
``EmbeddingBagConfig``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sparsecore.input_checks import check_table_names, positive_int
from sparsecore.optimizers import SGD, OptimizerSpec
from tpu_facts import (
    COMBINERS,
    DEFAULT_MAX_IDS_PER_PARTITION,
    MAX_VOCAB,
    ChipGeneration,
    DeviceCounts,
    Slice,
    check_mod_sharding,
    chip_generation,
)


@dataclass(frozen=True)
class Initializer:
    """How a table's rows are initialised: ``uniform`` in [low, high], ``normal`` (mean, std) or
    ``constant`` (value)."""

    kind: str = "uniform"
    low: float = -0.01
    high: float = 0.01
    mean: float = 0.0
    std: float = 0.01
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("uniform", "normal", "constant"):
            raise ValueError(f"initializer kind must be uniform/normal/constant, got {self.kind!r}")
        if self.kind == "uniform" and not self.low <= self.high:
            raise ValueError(f"uniform initializer needs low <= high, got [{self.low}, {self.high}]")
        if self.kind == "normal" and self.std < 0:
            raise ValueError(f"normal initializer needs std >= 0, got {self.std}")

    def sample(self, rows: int, dim: int, generator: torch.Generator) -> torch.Tensor:
        """A float32 [rows, dim] tensor drawn with ``generator``."""
        out = torch.empty(rows, dim, dtype=torch.float32)
        if self.kind == "uniform":
            return out.uniform_(self.low, self.high, generator=generator)
        if self.kind == "normal":
            return out.normal_(self.mean, self.std, generator=generator)
        return out.fill_(self.value)


def torchrec_default_initializer(vocab_size: int) -> Initializer:
    """TorchRec's EmbeddingBagConfig default: uniform in +-sqrt(1 / num_embeddings)."""
    bound = math.sqrt(1.0 / vocab_size)
    return Initializer("uniform", low=-bound, high=bound)


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: ``vocab_size`` rows of ``dim`` floats, pooled with ``combiner``.

    ``max_ids_per_partition`` / ``max_unique_ids_per_partition`` bound how many (unique) ids one
    SparseCore may receive from one source SparseCore per step; they size the device buffers.
    """

    name: str
    vocab_size: int
    dim: int
    combiner: str = "sum"
    optimizer: OptimizerSpec = field(default_factory=SGD)
    initializer: Initializer | None = None  # None: TorchRec's default for this vocab size
    max_ids_per_partition: int = DEFAULT_MAX_IDS_PER_PARTITION
    max_unique_ids_per_partition: int = DEFAULT_MAX_IDS_PER_PARTITION

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("table name must be a non-empty string")
        where = f"table {self.name!r}"
        if not isinstance(self.vocab_size, int) or not 1 <= self.vocab_size <= MAX_VOCAB:
            raise ValueError(f"{where}: vocab_size must be an int in [1, {MAX_VOCAB}], got {self.vocab_size!r}")
        if not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"{where}: dim must be a positive int, got {self.dim!r}")
        if self.combiner not in COMBINERS:
            raise ValueError(f"{where}: combiner must be one of {COMBINERS}, got {self.combiner!r}")
        if not isinstance(self.optimizer, OptimizerSpec):
            raise TypeError(f"{where}: optimizer must be an OptimizerSpec, got {type(self.optimizer).__name__}")
        for key in ("max_ids_per_partition", "max_unique_ids_per_partition"):
            positive_int(getattr(self, key), f"{where}: {key}")
        if self.max_unique_ids_per_partition > self.max_ids_per_partition:
            raise ValueError(
                f"{where}: max_unique_ids_per_partition ({self.max_unique_ids_per_partition}) "
                f"exceeds max_ids_per_partition ({self.max_ids_per_partition})"
            )

    @property
    def effective_initializer(self) -> Initializer:
        return self.initializer or torchrec_default_initializer(self.vocab_size)

    def init_weights(self, seed: int = 0) -> torch.Tensor:
        """Fresh [vocab_size, dim] weights; each table draws from its own seed (name-derived)."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(self.name.encode()))
        return self.effective_initializer.sample(self.vocab_size, self.dim, generator)


@dataclass(frozen=True)
class FeatureSpec:
    """One sparse input feature looking up ``table``.

    ``batch_size`` is the samples the feature's input holds where the spec is used (jax-tpu-embedding's
    ``input_shape[0]``): this rank's batch (``local_batch``) in the features given to a sharded
    EBC, the global batch of every rank's samples (padded) in a backend's plan, which sees them all
    (:mod:`tpu_facts.batches`). ``max_ids_per_sample`` is the fixed valency of a dense
    [batch, valency] input, or None for ragged (multi-hot, variable length) input. Weighted
    features carry one float weight per id (KJT weights); unweighted ones use weight 1.
    """

    name: str
    table: str
    batch_size: int
    max_ids_per_sample: int | None = None
    weighted: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("feature name must be a non-empty string")
        if self.batch_size < 1:
            raise ValueError(f"feature {self.name!r}: batch_size must be >= 1, got {self.batch_size}")
        if self.max_ids_per_sample is not None and self.max_ids_per_sample < 1:
            raise ValueError(
                f"feature {self.name!r}: max_ids_per_sample must be >= 1 or None, got {self.max_ids_per_sample}"
            )

    @property
    def input_shape(self) -> tuple[int, int | None]:
        return (self.batch_size, self.max_ids_per_sample)


@dataclass(frozen=True)
class SparseCoreTopology(DeviceCounts):
    """The SparseCores one engine instance lays its stacks over: the JAX devices of ``num_chips``
    chips of one TPU ``generation``, or only ``num_devices`` of them (one tpu7x chiplet).

    Preprocessing works per JAX device: a chip may show up as several devices (TPU7x: two
    chiplets of two SparseCores each), so ids and samples are split over ``num_devices``. A
    training rank's share of a planned :class:`~tpu_facts.Slice` is :meth:`for_rank`.
    """

    generation: str = "v5p"
    num_chips: int = 1
    num_devices: int | None = None  # None: every device of the num_chips chips

    def __post_init__(self) -> None:
        chip = chip_generation(self.generation)  # raises on unknown generations
        if not isinstance(self.num_chips, int) or self.num_chips < 1:
            raise ValueError(f"num_chips must be a positive int, got {self.num_chips!r}")
        whole = self.num_chips * chip.devices_per_chip
        if self.num_devices is None:
            object.__setattr__(self, "num_devices", whole)
        elif not isinstance(self.num_devices, int) or not whole - chip.devices_per_chip < self.num_devices <= whole:
            raise ValueError(f"num_devices={self.num_devices!r} does not fit {self.num_chips} {chip.name} chip(s) "
                             f"of {chip.devices_per_chip} device(s) each")
        check_mod_sharding(self.num_sparsecores, f"{self.num_chips} {chip.name} chip(s) ({self.num_devices} "
                                                 f"devices x {chip.sparsecores_per_device} SparseCores)")

    @classmethod
    def for_rank(cls, topology: Slice, world_size: int) -> SparseCoreTopology:
        """The devices one of ``world_size`` equal ranks drives on ``topology`` (a plan's slice)."""
        devices = topology.devices_per_rank(world_size)
        return cls(topology.chip.name, -(-devices // topology.chip.devices_per_chip), devices)

    @property
    def chip(self) -> ChipGeneration:  # type: ignore[override]  (a property over DeviceCounts' field)
        return chip_generation(self.generation)

    @property
    def hbm_bytes_per_chip(self) -> int:
        return self.chip.hbm_bytes


def validate_specs(tables: Sequence[TableSpec], features: Sequence[FeatureSpec]) -> dict[str, TableSpec]:
    """Check names are unique and every feature names a known table; returns tables by name."""
    by_name = {table.name: table for table in tables}
    check_table_names((t.name, []) for t in tables)
    tables_of: dict[str, str] = {}
    for feature in features:
        if feature.name in tables_of:
            raise ValueError(f"duplicate feature name {feature.name!r} (tables {tables_of[feature.name]!r} and "
                             f"{feature.table!r}): a feature looks up one table")
        tables_of[feature.name] = feature.table
    for feature in features:
        if feature.table not in by_name:
            raise ValueError(
                f"feature {feature.name!r} looks up unknown table {feature.table!r}; "
                f"known tables: {sorted(by_name)}"
            )
    unused = sorted(set(by_name) - {f.table for f in features})
    if unused:
        raise ValueError(f"tables {unused} are not looked up by any feature")
    return by_name
