"""``torchrec.experimental.torch_tpu.modules`` on sparsecore: the table configs and the fused
SparseCore embedding collections."""

from torchrec_tpu.experimental.modules.embedding_configs import (
    SparseCoreEmbeddingConfig,
    StackedSparseCoreEmbeddingConfig,
)
from torchrec_tpu.experimental.modules.fused_embedding_modules import (
    SparseCoreFusedEmbeddingBagCollection,
    SparseCoreFusedEmbeddingCollection,
)
from torchrec_tpu.experimental.modules.fused_optimizer import SparseCoreFusedOptimizer

__all__ = [
    "SparseCoreEmbeddingConfig", "SparseCoreFusedEmbeddingBagCollection", "SparseCoreFusedEmbeddingCollection",
    "SparseCoreFusedOptimizer", "StackedSparseCoreEmbeddingConfig",
]
