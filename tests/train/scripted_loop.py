"""A tiny model, its batches and a scripted step function: the training loop's tests drive
``run_training`` with these instead of a DLRM."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torch_tpu  # noqa: F401  (the tpu device)


class Logistic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, batch: Batch):
        logits = self.linear(batch.dense_features).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def constant_batches(n: int) -> list[Batch]:
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.zeros(4, dtype=torch.long),
                                              lengths=torch.ones(4, dtype=torch.int32))
    return [Batch(dense_features=torch.full((4, 2), float(i)), sparse_features=kjt,
                  labels=torch.tensor([0.0, 1.0, 0.0, 1.0])) for i in range(n)]


class ScriptedSteps:
    """A step function returning the given losses as tpu tensors (lazy, like the compiled step)."""

    def __init__(self, losses: list[float]) -> None:
        self.losses, self.calls = losses, 0

    def __call__(self, model, optimizer, batch) -> torch.Tensor:
        loss = torch.tensor(self.losses[self.calls]).to("tpu")
        self.calls += 1
        return loss
