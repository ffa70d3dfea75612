"""A small stock-TorchRec DLRM case the eager and the compiled tpu tests share: one table of 20
rows and dim ``dim`` per feature, and one batch (empty bags included) with its loss on a device."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def one_table_per_feature(features: int, dim: int) -> tuple[list[str], list]:
    """(feature names, their ``EmbeddingBagConfig``s)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    keys = [f"f{i}" for i in range(features)]
    return keys, [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=20, feature_names=[k])
                  for i, k in enumerate(keys)]


@dataclass(frozen=True)
class DlrmBatch:
    keys: list[str]
    lengths: torch.Tensor
    values: torch.Tensor
    dense: torch.Tensor
    labels: torch.Tensor

    @staticmethod
    def random(keys: list[str], batch: int, dense_in: int) -> DlrmBatch:
        """A batch from its own generator (seed 0): the same whatever the global RNG did."""
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g)  # empty bags included
        values = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
        dense, labels = torch.randn(batch, dense_in, generator=g), torch.randint(0, 2, (batch,), generator=g).float()
        return DlrmBatch(keys, lengths, values, dense, labels)

    def loss(self, model: torch.nn.Module, device: str) -> torch.Tensor:
        """``model``'s binary cross-entropy on this batch, moved to ``device``."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        kjt = KeyedJaggedTensor.from_lengths_sync(keys=self.keys, values=self.values.to(device),
                                                  lengths=self.lengths.to(device))
        logits = model(self.dense.to(device), kjt).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, self.labels.to(device))
