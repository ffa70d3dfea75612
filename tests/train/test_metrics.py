"""Held-out evaluation against a hand-computed AUC (Mann-Whitney) and torch's BCE."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_tpu.train.metrics import evaluate, padded


class FirstDenseColumnIsTheLogit(nn.Module):
    """A fixed scorer with the DLRMTrain output contract."""

    def forward(self, batch: Batch):
        logits = batch.dense_features[:, 0]
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits, batch.labels)


def _batch(logits: np.ndarray, labels: np.ndarray) -> Batch:
    n = len(labels)
    sparse = KeyedJaggedTensor.from_lengths_sync(["C1"], torch.zeros(n, dtype=torch.int64),
                                                 torch.ones(n, dtype=torch.int32))
    dense = torch.from_numpy(np.stack([logits, np.zeros(n)], axis=1).astype(np.float32))
    return Batch(dense, sparse, torch.from_numpy(labels.astype(np.float32)))


def _mann_whitney_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


@pytest.mark.parametrize("batch_rows", [0, 400])  # 400: each batch padded, an empty one all padding
def test_auc_and_loss_over_uneven_batches_match_references(batch_rows: int) -> None:
    rng = np.random.default_rng(0)
    labels = (rng.random(1000) < 0.3).astype(np.int64)
    logits = np.round(rng.normal(labels * 0.8, 1.0), 1)  # rounding makes ties
    cuts = [0, 300, 700, 1000, 1000]
    batches = [_batch(logits[a:b], labels[a:b]) for a, b in zip(cuts, cuts[1:])]
    model = FirstDenseColumnIsTheLogit().train()

    result = evaluate(model, batches, torch.device("cpu"), batch_rows=batch_rows)

    assert model.training  # restored
    assert result.samples == 1000
    assert result.auc == pytest.approx(_mann_whitney_auc(logits, labels), abs=1e-6)
    expected_loss = nn.functional.binary_cross_entropy_with_logits(
        torch.tensor(logits), torch.tensor(labels, dtype=torch.float64)
    ).item()
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)


def test_padding_appends_zero_rows_and_empty_bags_to_every_key() -> None:
    sparse = KeyedJaggedTensor.from_lengths_sync(["C1", "C2"], torch.arange(5), torch.tensor([1, 2, 0, 2]))
    batch = Batch(torch.ones(2, 3), sparse, torch.ones(2))

    wider = padded(batch, 4)

    assert wider.dense_features.tolist() == [[1.0] * 3] * 2 + [[0.0] * 3] * 2
    assert wider.labels.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert wider.sparse_features["C1"].lengths().tolist() == [1, 2, 0, 0]
    assert wider.sparse_features["C2"].lengths().tolist() == [0, 2, 0, 0]
    assert wider.sparse_features["C2"].values().tolist() == [3, 4]


def test_empty_eval_split_is_an_error() -> None:
    with pytest.raises(ValueError, match="evaluation split is empty"):
        evaluate(FirstDenseColumnIsTheLogit(), [], torch.device("cpu"))
