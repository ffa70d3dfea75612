"""``torchrec.experimental.torch_tpu.datasets.dataloader``: a TorchRec ``Batch`` whose sparse
features are already preprocessed for SparseCore, and a loader wrapper that makes them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torchrec.datasets.utils import Batch

from torchrec_tpu.experimental.datasets.input_preprocessing import (
    KeyedSparseCorePreprocessedInput,
    SparseCoreInputPreprocessor,
)


@dataclasses.dataclass
class SparseCoreBatch(Batch):
    """``dense_features`` and ``labels`` as in a ``Batch`` (either may be None); ``sparse_features``
    preprocessed."""

    sparse_features: KeyedSparseCorePreprocessedInput

    @classmethod
    def from_batch(cls, batch: Batch, preprocessor: SparseCoreInputPreprocessor) -> SparseCoreBatch:
        """``batch`` with its KJT preprocessed on the host by ``preprocessor``."""
        return cls(dense_features=batch.dense_features, sparse_features=preprocessor(batch.sparse_features),
                   labels=batch.labels)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SparseCoreBatch:
        """A copy with every tensor on ``device``."""
        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device, non_blocking=non_blocking)

        return SparseCoreBatch(dense_features=move(self.dense_features),
                               sparse_features=self.sparse_features.to(device, non_blocking=non_blocking),
                               labels=move(self.labels))

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> SparseCoreBatch:
        """A copy with every tensor in pinned host memory."""
        return SparseCoreBatch(dense_features=self.dense_features.pin_memory(),
                               sparse_features=self.sparse_features.pin_memory(),
                               labels=self.labels.pin_memory())


class SparseCoreDataLoader:
    """Iterates ``dataloader``'s ``Batch``es as :class:`SparseCoreBatch`es (preprocessed in the
    iterating thread)."""

    def __init__(self, dataloader: Iterable[Batch], preprocessor: SparseCoreInputPreprocessor) -> None:
        self.dataloader = dataloader
        self.preprocessor = preprocessor

    def __iter__(self) -> Iterator[SparseCoreBatch]:
        for batch in self.dataloader:
            yield SparseCoreBatch.from_batch(batch, self.preprocessor)

    def __len__(self) -> int:
        return len(self.dataloader)  # type: ignore[arg-type]
