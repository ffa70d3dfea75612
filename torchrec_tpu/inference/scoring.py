"""A DLRM's forward split at the pooled embeddings: the tables' lookup, then the towers.

:class:`PooledDLRM` looks the batch up with the tables' module (its ``KeyedTensor`` values are
already ``[B, features * dim]`` in feature order) and hands them to the towers as ``[B, features,
dim]``, so TorchRec's ``SparseArch`` (a dict of the pooled values and a second concatenation) is
skipped. :func:`scoring_dlrm` serves a TorchRec ``DLRM`` / ``DLRM_DCN`` so, its dot interaction
(when it is exactly TorchRec's) gathering the upper triangle with ``index_select``
(:mod:`torchrec_tpu.train.engines.dot_interaction`) instead of advanced indexing. Both give
TorchRec's logits bit for bit.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torchrec.models.dlrm import InteractionArch, InteractionDCNArch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_tpu.train.engines.dot_interaction import OneMatmulInteractionArch


class Towers(nn.Module):
    """A DLRM's (or DLRM_DCN's) dense part: pooled embeddings and dense features -> logits.
    ``fast_interaction``: TorchRec's dot interaction by :class:`OneMatmulInteractionArch`'s forward
    (same outputs; left off where the module is exported with ``torch.export``)."""

    def __init__(self, dlrm: nn.Module, fast_interaction: bool = False) -> None:
        super().__init__()
        self.dense_arch, self.inter_arch, self.over_arch = dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch
        fast = fast_interaction and type(self.inter_arch) is InteractionArch
        self._interact = partial(OneMatmulInteractionArch.forward, self.inter_arch) if fast else self.inter_arch

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.over_arch(self._interact(dense_features=self.dense_arch(dense), sparse_features=pooled))

    def stacked(self, dense: torch.Tensor, stack: torch.Tensor) -> torch.Tensor:
        """The logits of ``dense`` and ``stack`` (``[B, features + 1, dim]``: the pooled
        embeddings at ``[:, 1:]``; slot 0 is overwritten with the dense output), which is then
        the interaction's concatenated input as it is: the same logits as :meth:`forward`."""
        batch, kind = dense.shape[0], type(self.inter_arch)
        features = self.dense_arch(dense)
        if kind is InteractionDCNArch:
            stack[:, 0] = features
            return self.over_arch(self.inter_arch.crossnet(stack.view(batch, -1)))
        if kind is not InteractionArch:
            return self.over_arch(self._interact(dense_features=features, sparse_features=stack[:, 1:]))
        stack[:, 0] = features
        rows, cols = self.inter_arch.triu_indices
        pairs = torch.bmm(stack, stack.transpose(1, 2)).view(batch, -1).index_select(1, rows * stack.shape[1] + cols)
        return self.over_arch(torch.cat((features, pairs), dim=1))


class PooledDLRM(nn.Module):
    """``(dense, KJT) -> logits``: ``tables`` (an EBC: one pooled column block per feature, in the
    towers' feature order) and ``towers`` (``(dense, pooled [B, features, dim]) -> logits``)."""

    def __init__(self, tables: nn.Module, towers: nn.Module, features: int,
                 feature_order: list[str] | None = None) -> None:
        super().__init__()
        self.tables, self.towers, self.features = tables, towers, features
        self.feature_order = feature_order  # given: the tables' keys are checked against it

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.tables(sparse)
        if self.feature_order is not None and pooled.keys() != self.feature_order:
            raise ValueError(f"the tables pool features {pooled.keys()}, the towers take {self.feature_order}")
        values = pooled.values()
        return self.towers(dense, values.reshape(values.shape[0], self.features, -1))


def scoring_dlrm(dlrm: nn.Module) -> nn.Module:
    """``dlrm`` (TorchRec's DLRM or DLRM_DCN, its EBC's features in its ``SparseArch`` order) as a
    :class:`PooledDLRM` sharing its modules: the same logits with less work per batch."""
    sparse_arch = dlrm.sparse_arch
    return PooledDLRM(sparse_arch.embedding_bag_collection, Towers(dlrm, fast_interaction=True), sparse_arch.F,
                      list(sparse_arch.sparse_feature_names))
