"""Stock TorchRec reference for the sharded EmbeddingCollection: an unsharded EmbeddingCollection
trained with a dense torch optimizer (which leaves untouched rows unchanged, like a fused update)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor

from .reference import OPTIMIZERS, random_kjt

DIM = 8  # TorchRec's EmbeddingCollection wants one dim for all tables
EC_CONFIGS = [
    EmbeddingConfig(num_embeddings=40, embedding_dim=DIM, name="t_user", feature_names=["user"]),
    EmbeddingConfig(num_embeddings=30, embedding_dim=DIM, name="t_item", feature_names=["item", "hist"]),
    EmbeddingConfig(num_embeddings=9, embedding_dim=DIM, name="t_small", feature_names=["small"]),
]


def reference_ec(seed: int = 0) -> EmbeddingCollection:
    torch.manual_seed(seed)
    return EmbeddingCollection(tables=EC_CONFIGS, device=torch.device("cpu"))


def sequence_loss(out: dict[str, JaggedTensor], step: int) -> torch.Tensor:
    """0.5 * |embedding - target|^2 summed over all ids, one random target per feature and step."""
    targets = torch.randn(len(out), DIM, generator=torch.Generator().manual_seed(2000 + step))
    return sum(0.5 * ((jt.values() - targets[i]) ** 2).sum() for i, (_, jt) in enumerate(sorted(out.items())))


def train_reference_ec(optimizer: str,
                       batches: Sequence[int]) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Per step (of ``batches[step]`` samples) the embedding values of every feature, and the
    final weights, of stock TorchRec."""
    ec = reference_ec()
    opt = OPTIMIZERS[optimizer][1](list(ec.parameters()))
    outputs = []
    for step, batch in enumerate(batches):
        out = ec(random_kjt(batch, step))
        outputs.append({name: jt.values().detach().clone() for name, jt in out.items()})
        opt.zero_grad()
        sequence_loss(out, step).backward()
        opt.step()
    return outputs, {name: emb.weight.detach().clone() for name, emb in ec.embeddings.items()}
