"""TorchRec's TPU module API (``torchrec.experimental.torch_tpu``) on this project's engines: a
script written for it runs after replacing that prefix with ``torchrec_tpu.experimental``.

Here: table configs and the fused SparseCore EBC / EC (``modules``, on torch_tpu's
``tpu::sparse_dense_matmul`` ops), host input preprocessing (``datasets``, on sparsecore) and
DCP planners for the MOD-sharded tables (``checkpoint``).
"""

from torchrec_tpu.experimental.checkpoint import SparseCoreLoadPlanner, SparseCoreSavePlanner
from torchrec_tpu.experimental.datasets import (
    KeyedSparseCorePreprocessedInput,
    SparseCoreBatch,
    SparseCoreDataLoader,
    SparseCoreInputPreprocessor,
    SparseCorePreprocessedInput,
)
from torchrec_tpu.experimental.modules import (
    SparseCoreEmbeddingConfig,
    SparseCoreFusedEmbeddingBagCollection,
    SparseCoreFusedEmbeddingCollection,
    SparseCoreFusedOptimizer,
    StackedSparseCoreEmbeddingConfig,
)

__all__ = [
    "KeyedSparseCorePreprocessedInput", "SparseCoreBatch", "SparseCoreDataLoader", "SparseCoreEmbeddingConfig",
    "SparseCoreFusedEmbeddingBagCollection", "SparseCoreFusedEmbeddingCollection", "SparseCoreFusedOptimizer",
    "SparseCoreInputPreprocessor", "SparseCoreLoadPlanner", "SparseCorePreprocessedInput", "SparseCoreSavePlanner",
    "StackedSparseCoreEmbeddingConfig",
]
