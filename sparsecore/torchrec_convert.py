"""Conversion between sparsecore specs and TorchRec table configs: ``EmbeddingBagConfig`` (pooled)
and ``EmbeddingConfig`` (sequence lookups, whose specs keep the "sum" combiner they never use)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig, PoolingType

from sparsecore.optimizers import SGD, OptimizerSpec
from sparsecore.specs import FeatureSpec, Initializer, TableSpec

_POOLING_TO_COMBINER = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}
_COMBINER_TO_POOLING = {v: k for k, v in _POOLING_TO_COMBINER.items()}


def specs_from_configs(
    configs: Sequence[BaseEmbeddingConfig],
    batch_size: int,
    *,
    optimizer: OptimizerSpec | None = None,
    weighted_features: Collection[str] = (),
    partition_limits: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[list[TableSpec], list[FeatureSpec]]:
    """Tables (one per config) and features (one per feature name) for a TorchRec EBC or EC layout.

    ``partition_limits`` maps a table name to its (max_ids_per_partition,
    max_unique_ids_per_partition); tables not named keep ``TableSpec``'s defaults.
    """
    partition_limits = dict(partition_limits or {})
    unknown_tables = sorted(set(partition_limits) - {c.name for c in configs})
    if unknown_tables:
        raise ValueError(f"partition_limits name tables {unknown_tables} that are not among the configs "
                         f"{[c.name for c in configs]}")
    tables, features = [], []
    for config in configs:
        pooling = config.pooling if isinstance(config, EmbeddingBagConfig) else PoolingType.SUM
        if pooling not in _POOLING_TO_COMBINER:
            raise ValueError(f"table {config.name!r}: pooling {pooling} has no SparseCore combiner")
        initializer = None
        if config.weight_init_min is not None or config.weight_init_max is not None:
            if config.weight_init_min is None or config.weight_init_max is None:
                raise ValueError(f"table {config.name!r}: set both weight_init_min and weight_init_max, or neither")
            initializer = Initializer("uniform", low=config.weight_init_min, high=config.weight_init_max)
        tables.append(TableSpec(
            name=config.name, vocab_size=config.num_embeddings, dim=config.embedding_dim,
            combiner=_POOLING_TO_COMBINER[pooling], optimizer=optimizer or SGD(),
            initializer=initializer, **_limit_fields(partition_limits.get(config.name)),
        ))
        features.extend(
            FeatureSpec(name, config.name, batch_size, weighted=name in weighted_features)
            for name in config.feature_names
        )
    unknown = sorted(set(weighted_features) - {f.name for f in features})
    if unknown:
        raise ValueError(f"weighted_features {unknown} are not features of any config")
    return tables, features


def _limit_fields(limits: tuple[int, int] | None) -> dict[str, int]:
    if limits is None:
        return {}
    max_ids, max_unique_ids = limits
    return {"max_ids_per_partition": max_ids, "max_unique_ids_per_partition": max_unique_ids}


def configs_from_specs(tables: Sequence[TableSpec], features: Sequence[FeatureSpec],
                       pooled: bool = True) -> list[BaseEmbeddingConfig]:
    """TorchRec configs for the tables, each listing the features that look it up:
    ``EmbeddingBagConfig``s, or ``EmbeddingConfig``s (no pooling) unless ``pooled``."""
    configs: list[BaseEmbeddingConfig] = []
    for table in tables:
        if pooled and table.combiner not in _COMBINER_TO_POOLING:
            raise ValueError(f"table {table.name!r}: combiner {table.combiner!r} has no TorchRec pooling type")
        init = table.effective_initializer
        if init.kind != "uniform":
            raise ValueError(f"table {table.name!r}: TorchRec configs only express uniform initializers, "
                             f"got {init.kind}")
        common = dict(num_embeddings=table.vocab_size, embedding_dim=table.dim, name=table.name,
                      feature_names=[f.name for f in features if f.table == table.name],
                      weight_init_min=init.low, weight_init_max=init.high)
        configs.append(EmbeddingBagConfig(**common, pooling=_COMBINER_TO_POOLING[table.combiner]) if pooled
                       else EmbeddingConfig(**common))
    return configs
