"""HSTU's sequence tables on SparseCore: the project's sharded EmbeddingCollection
(:class:`~torchrec_tpu.sharding.ShardedSparseCoreEC`) built for :func:`~torchrec_tpu.hstu.model.table_configs`,
with a fused row-wise Adagrad update by default (MLPerf DLRMv4's sparse optimizer)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torchrec import EmbeddingCollection

from sparsecore.optimizers import OptimizerSpec, RowWiseAdagrad
from torchrec_tpu.hstu.config import HSTUConfig
from torchrec_tpu.hstu.model import TABLES, table_configs
from torchrec_tpu.sharding import ShardedSparseCoreEC, TableSharding

DEFAULT_SPARSE_LR = 0.05


def sharded_embeddings(config: HSTUConfig, sharding: Mapping[str, TableSharding] | str = "row_wise", *,
                       optimizer: OptimizerSpec | None = None, local_batch: int = 32,
                       ec: EmbeddingCollection | None = None, **options: Any) -> ShardedSparseCoreEC:
    """The HSTU tables sharded as ``sharding`` says (one kind for all, or per table name), their
    weights taken from ``ec`` (default: a fresh seeded CPU EmbeddingCollection), for batches of
    ``local_batch`` samples per rank (their first lookup buffers' size); ``options`` go to
    :class:`ShardedSparseCoreEC` (``backend``, ``group``, ``average_over_ranks``...)."""
    if isinstance(sharding, str):
        sharding = {name: TableSharding(sharding, (0,) if sharding == "table_wise" else ()) for name in TABLES}
    if set(sharding) != set(TABLES):
        raise ValueError(f"HSTU sharding names tables {sorted(sharding)}; expected {sorted(TABLES)}")
    ec = ec if ec is not None else EmbeddingCollection(tables=table_configs(config), device=torch.device("cpu"))
    spec = optimizer if optimizer is not None else RowWiseAdagrad(DEFAULT_SPARSE_LR)
    return ShardedSparseCoreEC.from_torchrec(ec, sharding, spec, local_batch, **options)
