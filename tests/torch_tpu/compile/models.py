"""Small MLP / DLRM dense tower / DCN models shared by the compile tests and the benchmark."""

from __future__ import annotations

import torch
from torch import nn


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRMDense(nn.Module):
    """DLRM without embedding tables: bottom MLP, pairwise dot interaction with pooled embeddings
    (given as a dense input), top MLP -> one logit per sample."""

    def __init__(self, dense_in: int = 13, dim: int = 16, num_sparse: int = 4, top: tuple[int, ...] = (32, 16)) -> None:
        super().__init__()
        self.bottom = mlp([dense_in, 32, dim])
        self.num = num_sparse + 1
        pairs = self.num * (self.num - 1) // 2
        self.top = mlp([dim + pairs, *top, 1])
        rows, cols = torch.triu_indices(self.num, self.num, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        feats = torch.cat([x.unsqueeze(1), pooled], dim=1)
        inter = torch.bmm(feats, feats.transpose(1, 2))[:, self.rows, self.cols]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


class DCN(nn.Module):
    """DCNv2 low-rank cross network followed by a deep tower."""

    def __init__(self, dim: int = 24, layers: int = 2, rank: int = 8) -> None:
        super().__init__()
        self.u = nn.ModuleList(nn.Linear(dim, rank, bias=False) for _ in range(layers))
        self.v = nn.ModuleList(nn.Linear(rank, dim) for _ in range(layers))
        self.deep = mlp([dim, 16, 1])

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for u, v in zip(self.u, self.v):
            x = x0 * v(u(x)) + x
        return self.deep(x).squeeze(1)
