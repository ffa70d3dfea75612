"""``torchrec.experimental.torch_tpu.modules`` on sparsecore: the table configs."""

from torchrec_tpu.experimental.modules.embedding_configs import (
    SparseCoreEmbeddingConfig,
    StackedSparseCoreEmbeddingConfig,
)

__all__ = ["SparseCoreEmbeddingConfig", "StackedSparseCoreEmbeddingConfig"]
