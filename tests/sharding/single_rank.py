"""One rank's sharded EBC built from the reference EBC, table-wise on device 0."""

from __future__ import annotations

from torchrec_tpu.sharding import ShardedSparseCoreEBC, TableSharding

from .reference import CONFIGS, OPTIMIZERS, reference_ebc

BATCH = 16


def sharded_ebc(optimizer: str, backend: str = "xla") -> ShardedSparseCoreEBC:
    plan = {c.name: TableSharding("table_wise", (0,)) for c in CONFIGS}
    return ShardedSparseCoreEBC.from_torchrec(reference_ebc(), BATCH, plan, OPTIMIZERS[optimizer][0], backend=backend)
