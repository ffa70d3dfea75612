"""HR@K, NDCG@K and MRR over all items with the seen items left out, as the HSTU paper's code
computes them: hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from torchrec_tpu.hstu.retrieval_metrics import MAX_K, retrieval_metrics, target_ranks

SCORES = torch.tensor([[0.1, 0.9, 0.5, 0.7, 0.3, 0.8],
                       [0.6, 0.2, 0.4, 0.1, 0.9, 0.3],
                       [0.5, 0.2, 0.4, 0.1, 0.9, 0.3]])
TARGETS = torch.tensor([2, 0, 1])
SEEN = torch.tensor([[1, -1], [4, 3], [1, 5]])  # -1: padding


def test_ranks_leave_the_seen_items_out():
    # user 0: item 1 (0.9) seen, items 5 (0.8) and 3 (0.7) above the target (0.5): rank 3
    # user 1: item 4 (0.9) seen, nothing else above the target (0.6): rank 1
    # user 2: the target itself was seen: a miss, rank MAX_K + 1
    assert target_ranks(SCORES, TARGETS, SEEN).tolist() == [3, 1, MAX_K + 1]
    assert target_ranks(SCORES, TARGETS, SEEN[:, :0]).tolist() == [4, 2, 5]  # nothing left out
    assert target_ranks(SCORES, TARGETS, SEEN, max_k=2).tolist() == [3, 1, 3]  # rank 3 is below the top 2


def test_metrics_of_hand_computed_ranks():
    got = retrieval_metrics(torch.tensor([3, 1, MAX_K + 1]), hit_ks=(1, 10), ndcg_ks=(1, 10))
    assert got["hr@1"] == pytest.approx(1 / 3) and got["hr@10"] == pytest.approx(2 / 3)
    assert got["ndcg@1"] == pytest.approx(1 / 3)  # 1 / log2(2) for the rank-1 user
    assert got["ndcg@10"] == pytest.approx((1 / 2 + 1) / 3)  # 1 / log2(4) + 1 / log2(2)
    assert got["mrr"] == pytest.approx((1 / 3 + 1 + 1 / (MAX_K + 1)) / 3)
    assert set(retrieval_metrics(torch.tensor([1]))) == {"hr@10", "hr@50", "hr@200", "ndcg@10", "mrr"}


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match=r"target_ranks: scores must be \[B, items\], targets \[B\]"):
        target_ranks(SCORES, TARGETS[:2], SEEN)
    with pytest.raises(ValueError, match=r"target_ranks: a target id is outside \[0, 6\)"):
        target_ranks(SCORES, torch.tensor([2, 0, 6]), SEEN)
    with pytest.raises(ValueError, match="no users to average over"):
        retrieval_metrics(torch.tensor([], dtype=torch.int64))
