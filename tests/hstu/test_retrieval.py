"""The retrieval task's pieces: leave-one-out by hand, the sampled softmax loss against a plain-torch
loop over positions, its negatives, and HR/NDCG/MRR of a fixed model output computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torchrec_tpu.hstu.retrieval import evaluate_retrieval, leave_one_out, sample_negatives, sampled_softmax_loss


def test_leave_one_out_by_hand() -> None:
    user = np.array([2, 1, 1, 1, 2, 2, 2, 3, 3, 1])
    item = np.array([20, 11, 12, 13, 21, 22, 23, 30, 31, 14])
    time = np.array([5, 1, 2, 3, 1, 2, 9, 1, 2, 4])  # user 2 by time: 21, 22, 20, 23
    split = leave_one_out(user, item, time)
    assert split.users.tolist() == [1, 2]  # user 3 has 2 events: dropped
    assert [t.tolist() for t in split.train] == [[11, 12], [21, 22]]
    assert split.valid.tolist() == [13, 20] and split.test.tolist() == [14, 23]
    assert [h.tolist() for h in split.history("test")] == [[11, 12, 13], [21, 22, 20]]


def test_sampled_softmax_equals_a_loop_over_positions() -> None:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    outputs = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    targets = torch.tensor([1, 3, 3, 0, 6])
    negatives = torch.tensor([[3, 2], [3, 1], [0, 4], [0, 0], [5, 6]])  # hits: row 1's 3, row 3's 0s, row 4's 6
    got = sampled_softmax_loss(outputs, targets, negatives, table, temperature=0.1)
    total = 0.0
    for n in range(5):
        q = outputs[n] / outputs[n].norm()

        def sim(i):
            return float(q @ (table[i] / table[i].norm())) / 0.1

        others = [math.exp(sim(int(i))) for i in negatives[n] if int(i) != int(targets[n])]
        total += -math.log(math.exp(sim(int(targets[n]))) / (math.exp(sim(int(targets[n]))) + sum(others)))
    assert float(got) == pytest.approx(total / 5, rel=1e-12)


def test_negatives_come_from_the_batch_then_the_table() -> None:
    targets = torch.tensor([100, 200, 300])
    negatives = sample_negatives(targets, items=50, in_batch=4, random=6, generator=torch.Generator().manual_seed(1))
    assert negatives.shape == (3, 10)
    assert set(negatives[:, :4].flatten().tolist()) <= {100, 200, 300}
    assert int(negatives[:, 4:].min()) >= 0 and int(negatives[:, 4:].max()) < 50
    with pytest.raises(ValueError, match=r"in_batch=0, random=0 negatives"):
        sample_negatives(targets, 50, 0, 0)


def test_metrics_of_a_fixed_output_by_hand() -> None:
    table = torch.eye(5)  # item j's score: the output's normalized j-th entry
    outputs = torch.tensor([[0.1, 0.5, 0.3, 0.9, 0.2], [0.4, 0.3, 0.2, 0.1, 0.0]])
    targets = torch.tensor([2, 0])
    seen = torch.tensor([[3, -1], [0, 4]])  # user 0: item 3 left out, so only item 1 ranks above: rank 2;
    metrics = evaluate_retrieval(outputs, table, targets, seen)  # user 1's target was seen: a miss, 2,501
    assert metrics["hr@10"] == 0.5 and metrics["hr@200"] == 0.5
    assert metrics["ndcg@10"] == pytest.approx(0.5 / math.log2(3))
    assert metrics["mrr"] == pytest.approx((1 / 2 + 1 / 2501) / 2)
