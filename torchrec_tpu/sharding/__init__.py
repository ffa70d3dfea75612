"""Sharded EmbeddingBagCollection and EmbeddingCollection on the sparsecore engine (table-, row-,
column-wise and data-parallel over a process group), with TorchRec inputs (KJT) and outputs
(KeyedTensor; dict of JaggedTensor)."""

from torchrec_tpu.sharding.ebc import LocalBatch, PrefetchedKJT, ShardedSparseCoreEBC
from torchrec_tpu.sharding.ec import SequenceBatch, ShardedSparseCoreEC
from torchrec_tpu.sharding.sharded_tables import LocalEngine, ShardedTables
from torchrec_tpu.sharding.shards import SHARDING_TYPES, Shard, TableSharding, balanced_table_wise, make_shards

__all__ = ["SHARDING_TYPES", "LocalBatch", "LocalEngine", "PrefetchedKJT", "SequenceBatch", "Shard",
           "ShardedSparseCoreEBC", "ShardedSparseCoreEC", "ShardedTables", "TableSharding", "balanced_table_wise",
           "make_shards"]
