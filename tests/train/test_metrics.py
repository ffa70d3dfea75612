"""Held-out evaluation against a hand-computed AUC (Mann-Whitney), torch's BCE and TorchRec's
normalized entropy (``torchrec.metrics.ne``), and NE of a hand-computed case."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.metrics.ne import compute_cross_entropy, compute_ne
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_tpu.train.metrics import evaluate, normalized_entropy, padded


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
    assert result.ne == pytest.approx(_torchrec_ne(logits, labels), rel=1e-5)
    assert f"NE {result.ne:.4f}" in result.describe()


def _torchrec_ne(logits: np.ndarray, labels: np.ndarray) -> float:
    """TorchRec's NE of these predictions (its log2 cross entropy over its base-rate entropy)."""
    y, ones = torch.tensor(labels, dtype=torch.float64), torch.ones(len(labels), dtype=torch.float64)
    ce = compute_cross_entropy(y, torch.sigmoid(torch.tensor(logits, dtype=torch.float64)), ones, eta=1e-12)
    return float(compute_ne(ce.sum(), ones.sum(), y.sum(), (1 - y).sum(), eta=1e-12))


def test_ne_of_a_hand_computed_case() -> None:
    # labels 1, 0, 0, 0 (base rate 1/4) predicted 0.5 each: mean loss ln 2; entropy
    # -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335; NE = 0.693147 / 0.562335 = 1.232622
    result = evaluate(FirstDenseColumnIsTheLogit(), [_batch(np.zeros(4), np.array([1, 0, 0, 0]))], torch.device("cpu"))
    assert result.ne == pytest.approx(1.232622, abs=1e-6)
    # predicting the base rate everywhere is NE 1; one label everywhere leaves NE undefined
    assert normalized_entropy(-(0.25 * np.log(0.25) + 0.75 * np.log(0.75)), 0.25) == pytest.approx(1.0)
    assert np.isnan(normalized_entropy(0.1, 1.0))


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
