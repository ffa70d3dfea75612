"""The 2-rank SPMD step tests' model and batches: a linear layer whose rows every rank exchanges
(all-to-all) before the loss, and each rank's own random batch per step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class Exchanging(nn.Module):
    """A linear layer, then every rank's rows exchanged with all-to-all, then a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        h = self.linear(x)
        if group is not None:
            import torch.distributed._functional_collectives as fc

            h = fc.all_to_all_single_autograd(h, None, None, group)
        return ((h.tanh() - y) ** 2).mean()


def batch(rank: int, step: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs and targets of step ``step``."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 6, generator=g)
