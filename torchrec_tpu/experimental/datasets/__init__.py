"""``torchrec.experimental.torch_tpu.datasets`` on sparsecore: host preprocessing and batches."""

from torchrec_tpu.experimental.datasets.dataloader import SparseCoreBatch, SparseCoreDataLoader
from torchrec_tpu.experimental.datasets.input_preprocessing import (
    KeyedSparseCorePreprocessedInput,
    SparseCoreInputPreprocessor,
    SparseCorePreprocessedInput,
)

__all__ = [
    "KeyedSparseCorePreprocessedInput", "SparseCoreBatch", "SparseCoreDataLoader", "SparseCoreInputPreprocessor",
    "SparseCorePreprocessedInput",
]
