"""``torchrec.experimental.torch_tpu.modules.embedding_configs`` on sparsecore: a TorchRec table
config with its SparseCore input bounds, and the stacked table it lands in.

:func:`sparsecore_specs` maps the configs onto sparsecore ``TableSpec`` / ``FeatureSpec`` (the
partition limits go into each ``TableSpec``); :meth:`StackedSparseCoreEmbeddingConfig.from_stack`
describes a sparsecore ``StackedTable`` in TorchRec TPU's vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType

from sparsecore.specs import FeatureSpec, TableSpec
from sparsecore.stacking import StackedTable
from sparsecore.torchrec_convert import specs_from_configs


class _Reads:
    """A read-only attribute that is another one's value: a dotted path from the instance (a
    number steps into a list), as TorchRec TPU's configs pass their wrapped config's fields on."""

    def __init__(self, path: str) -> None:
        self.path = path.split(".")

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        for step in self.path:
            obj = obj[int(step)] if step.isdigit() else getattr(obj, step)
        return obj


@dataclasses.dataclass
class SparseCoreEmbeddingConfig:
    """A TorchRec ``EmbeddingBagConfig`` (pooled) or ``EmbeddingConfig`` (sequence) with the bounds
    SparseCore input preprocessing sizes its buffers by.

    ``max_seq_len``: ids per sample of a sequence table (required for ``EmbeddingConfig``);
    ``max_ids_per_partition`` / ``max_unique_ids_per_partition``: the (unique) ids one SparseCore
    may send another per step for this table; ``suggested_coo_buffer_size_per_device``: kept for
    scripts that set it (sparsecore always sizes a device's COO buffer for every partition at its
    limit, so it never truncates); ``stack_table_name``: tables naming the same stack share one
    stacked table (None: the table is its own stack unless the preprocessor's ``auto_stack``
    groups it).
    """

    config: EmbeddingConfig | EmbeddingBagConfig
    max_seq_len: int | None = None
    max_ids_per_partition: int = 256
    max_unique_ids_per_partition: int = 256
    suggested_coo_buffer_size_per_device: int = 32
    stack_table_name: str | None = None
    _stacked_config: StackedSparseCoreEmbeddingConfig | None = dataclasses.field(
        default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.config, (EmbeddingBagConfig, EmbeddingConfig)):
            raise TypeError(f"config must be a torchrec EmbeddingBagConfig or EmbeddingConfig, "
                            f"got {type(self.config).__name__}")
        where = f"table {self.config.name!r}"
        for key in ("max_ids_per_partition", "max_unique_ids_per_partition"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {key} must be a positive int, got {value!r}")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 1):
            raise ValueError(f"{where}: max_seq_len must be a positive int or None, got {self.max_seq_len!r}")

    name = _Reads("config.name")
    embedding_dim = _Reads("config.embedding_dim")
    num_embeddings = _Reads("config.num_embeddings")
    feature_names = _Reads("config.feature_names")
    init_fn = _Reads("config.init_fn")

    @property
    def pooling(self) -> PoolingType:
        if isinstance(self.config, EmbeddingBagConfig):
            return self.config.pooling
        raise AttributeError(f"table {self.name!r} wraps an EmbeddingConfig, which has no pooling")

    @property
    def is_unpooled(self) -> bool:
        return not isinstance(self.config, EmbeddingBagConfig)

    @property
    def stacked_config(self) -> StackedSparseCoreEmbeddingConfig | None:
        """The stack this table was placed in (set by ``SparseCoreInputPreprocessor``)."""
        return self._stacked_config

    def samples_per_sample(self) -> int:
        """Rows one input sample takes in the SparseCore batch: 1 pooled, ``max_seq_len`` for a
        sequence table (each id is its own row)."""
        if not self.is_unpooled:
            return 1
        if self.max_seq_len is None:
            raise ValueError(f"max_seq_len must be provided for EmbeddingConfig table {self.name!r}")
        return self.max_seq_len


def sparsecore_specs(tables: Sequence[SparseCoreEmbeddingConfig], global_batch_size: int
                     ) -> tuple[list[TableSpec], list[FeatureSpec]]:
    """sparsecore specs of ``tables`` at ``global_batch_size`` samples per feature: each table's
    partition limits go into its ``TableSpec``; a sequence table's features get
    ``global_batch_size * max_seq_len`` rows (one id each)."""
    table_specs, features = specs_from_configs(
        [t.config for t in tables], global_batch_size,
        partition_limits={t.name: (t.max_ids_per_partition, t.max_unique_ids_per_partition) for t in tables},
    )
    rows = {t.name: t.samples_per_sample() for t in tables}
    return table_specs, [dataclasses.replace(f, batch_size=f.batch_size * rows[f.table]) for f in features]


class _LargestOfTables:
    """A stack's limit: the value set on the stack (``_<name>``), else the largest of its tables'."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, stack: StackedSparseCoreEmbeddingConfig | None, owner: type | None = None) -> Any:
        if stack is None:
            return self
        override = getattr(stack, f"_{self.name}")
        return override if override is not None else max(getattr(t, self.name) for t in stack.tables)

    def __set__(self, stack: StackedSparseCoreEmbeddingConfig, value: int | None) -> None:
        setattr(stack, f"_{self.name}", value)


@dataclasses.dataclass
class StackedSparseCoreEmbeddingConfig:
    """One stacked table as TorchRec TPU describes it: its tables and features, its padded size,
    and where each table sits (row offset inside a SparseCore's shard, MOD-sharding rotation).

    The partition limits default to the largest of its tables' (set them to override).
    """

    stack_table_name: str
    tables: list[SparseCoreEmbeddingConfig]
    feature_names: list[str]
    stack_num_embeddings: int
    stack_embedding_dim: int
    total_sample_count_multiplier: int
    row_offsets_in_shard: dict[str, int]
    shard_rotations: dict[str, int]
    padded_vocab_sizes: dict[str, int]
    padded_embedding_dims: dict[str, int]
    _max_ids_per_partition: int | None = None
    _max_unique_ids_per_partition: int | None = None
    _suggested_coo_buffer_size_per_device: int | None = None

    @classmethod
    def from_stack(cls, stack: StackedTable, tables: Sequence[SparseCoreEmbeddingConfig]
                   ) -> StackedSparseCoreEmbeddingConfig:
        """The description of sparsecore ``stack``, whose tables are among ``tables``; sets each
        of those tables' ``stacked_config``."""
        by_name = {t.name: t for t in tables}
        members = [by_name[p.table] for p in stack.tables]
        out = cls(
            stack_table_name=stack.name, tables=members,
            feature_names=[fp.feature for fp in sorted(stack.features, key=lambda fp: fp.sample_offset)],
            stack_num_embeddings=stack.vocab_size, stack_embedding_dim=stack.dim,
            total_sample_count_multiplier=sum(len(t.feature_names) * t.samples_per_sample() for t in members),
            row_offsets_in_shard={p.table: p.row_offset_in_shard for p in stack.tables},
            shard_rotations={p.table: p.shard_rotation for p in stack.tables},
            padded_vocab_sizes={p.table: p.padded_vocab_size for p in stack.tables},
            padded_embedding_dims={p.table: stack.dim for p in stack.tables},
        )
        for table in members:
            table._stacked_config = out
        return out

    max_ids_per_partition = _LargestOfTables()
    max_unique_ids_per_partition = _LargestOfTables()
    suggested_coo_buffer_size_per_device = _LargestOfTables()

    name = _Reads("stack_table_name")
    stack_name = _Reads("stack_table_name")
    embedding_dim = _Reads("stack_embedding_dim")
    num_embeddings = _Reads("stack_num_embeddings")
    pooling = _Reads("tables.0.pooling")
    is_unpooled = _Reads("tables.0.is_unpooled")
    max_seq_len = _Reads("tables.0.max_seq_len")

    @property
    def total_features(self) -> int:
        return len(self.feature_names)

    def get_col_offset(self, table_name: str, num_sparsecores: int) -> int:
        """First id column of ``table_name`` in the stack: its row offset in a shard times the
        SparseCores."""
        return self.row_offsets_in_shard[table_name] * num_sparsecores

    def get_vocab_offset(self, table_name: str, num_sparsecores: int) -> int:
        """Same as :meth:`get_col_offset`."""
        return self.get_col_offset(table_name, num_sparsecores)

    def get_shard_rotation(self, table_name: str) -> int:
        """The MOD-sharding rotation of ``table_name`` in the stack."""
        return self.shard_rotations[table_name]

    def get_total_sample_count(self, batch_size: int) -> int:
        """Rows of the stack's SparseCore batch for a process-local ``batch_size``."""
        return self.total_sample_count_multiplier * batch_size
