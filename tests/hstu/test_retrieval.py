"""The retrieval task's pieces: leave-one-out by hand, the sampled softmax loss against a plain-torch
loop over positions, its negatives, HR/NDCG/MRR of a fixed model output computed by hand, and the
retrieval encoder against a plain-PyTorch reference of the paper code's forward."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.hstu import reference
from torchrec_tpu.hstu import retrieval
from torchrec_tpu.hstu.config import HSTUConfig
from torchrec_tpu.hstu.retrieval import leave_one_out, sample_negatives, sampled_softmax_loss, target_ranks_over
from torchrec_tpu.hstu.retrieval_job import sequence_batch
from torchrec_tpu.hstu.retrieval_metrics import retrieval_metrics
from torchrec_tpu.hstu.retrieval_model import RetrievalConfig, RetrievalHSTU


def test_leave_one_out_by_hand() -> None:
    user = np.array([2, 1, 1, 1, 2, 2, 2, 3, 3, 1])
    item = np.array([20, 11, 12, 13, 21, 22, 23, 30, 31, 14])
    time = np.array([5, 1, 2, 3, 1, 2, 9, 1, 2, 4])  # user 2 by time: 21, 22, 20, 23
    split = leave_one_out(user, item, time)
    assert split.users.tolist() == [1, 2]  # user 3 has 2 events: dropped
    assert [t.tolist() for t in split.train] == [[11, 12], [21, 22]]
    assert split.valid.tolist() == [13, 20] and split.test.tolist() == [14, 23]
    assert [h.tolist() for h in split.history("test")] == [[11, 12, 13], [21, 22, 20]]
    assert [h.tolist() for h in split.history_times("test")] == [[1, 2, 3], [1, 2, 5]]
    assert split.test_time.tolist() == [4, 9] and split.valid_time.tolist() == [3, 5]


@pytest.mark.parametrize("matmul_up_to", [16, 0])  # the matmul over distinct ids, and the gathered rows
def test_sampled_softmax_equals_a_loop_over_positions(matmul_up_to, monkeypatch) -> None:
    monkeypatch.setattr(retrieval, "MATMUL_ROWS_PER_COLUMN", matmul_up_to)
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


def test_both_ways_of_scoring_give_the_same_gradients(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(3)
    table, outputs = torch.randn(40, 6, generator=gen, dtype=torch.float64), torch.randn(9, 6, generator=gen,
                                                                                         dtype=torch.float64)
    targets, negatives = torch.randint(40, (9,), generator=gen), torch.randint(40, (9, 5), generator=gen)
    grads = []
    for matmul_up_to in (16, 0):
        monkeypatch.setattr(retrieval, "MATMUL_ROWS_PER_COLUMN", matmul_up_to)
        t, o = table.clone().requires_grad_(), outputs.clone().requires_grad_()
        sampled_softmax_loss(o, targets, negatives, t).backward()
        grads.append((t.grad, o.grad))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)
    assert grads[0][0].abs().sum() > 0


def test_negatives_come_from_the_batch_then_the_catalog() -> None:
    targets = torch.tensor([100, 200, 300, 100])
    pool, catalog = torch.tensor([100, 200, 300]), torch.tensor([3, 5, 7])
    gen = torch.Generator().manual_seed(1)
    negatives = sample_negatives(targets, pool, catalog, in_batch=4, random=6, generator=gen)
    assert negatives.shape == (4, 10)
    assert set(negatives[:, :4].flatten().tolist()) == {100, 200, 300}  # 16 draws: each id of the pool
    assert set(negatives[:, 4:].flatten().tolist()) == {3, 5, 7}
    assert sample_negatives(targets, pool, catalog, 0, 2).shape == (4, 2)
    with pytest.raises(ValueError, match=r"in_batch=0, random=0 negatives"):
        sample_negatives(targets, pool, catalog, 0, 0)


def test_metrics_of_a_fixed_output_by_hand() -> None:
    table = torch.eye(5)  # item j's score: the output's normalized j-th entry
    outputs = torch.tensor([[0.1, 0.5, 0.3, 0.9, 0.2], [0.4, 0.3, 0.2, 0.1, 0.0]])
    targets = torch.tensor([2, 0])
    seen = torch.tensor([[3, -1], [0, 4]])  # user 0: item 3 left out, so only item 1 ranks above: rank 2;
    metrics = retrieval_metrics(target_ranks_over(outputs, table, targets, seen))  # user 1's: seen, a miss
    assert metrics["hr@10"] == 0.5 and metrics["hr@200"] == 0.5
    assert metrics["ndcg@10"] == pytest.approx(0.5 / math.log2(3))
    assert metrics["mrr"] == pytest.approx((1 / 2 + 1 / 2501) / 2)


def test_the_catalog_limits_what_is_ranked() -> None:
    table = torch.eye(4)
    outputs = torch.tensor([[0.9, 0.8, 0.1, 0.7]])
    nothing_seen = torch.full((1, 1), -1)
    assert target_ranks_over(outputs, table, torch.tensor([3]), nothing_seen).tolist() == [3]
    assert target_ranks_over(outputs, table, torch.tensor([3]), nothing_seen, torch.tensor([1, 2, 3])).tolist() == [2]


def test_encoder_equals_the_paper_codes_forward_by_hand() -> None:
    """Each event's output equals the paper code's: e(item) sqrt(D) + p(position) through its STU
    layers (the reference's, in float64), the event's time bias at the next event's time (the last
    input's next event: the target, whose time the paper code scatters in), L2-normalized."""
    torch.manual_seed(0)
    config = RetrievalConfig(item_rows=30, dim=8, layers=2, heads=2, qk_dim=4, v_dim=4, max_history=6, dropout=0.2)
    model = RetrievalHSTU(config).eval()
    items = [np.array([3, 7, 1, 9, 4]), np.array([2, 5]), np.array([8, 6, 4, 29, 11, 12, 13, 14, 15])]
    times = [np.array([10, 50, 400, 9000, 9001]), np.array([5, 100_000]), np.arange(9) ** 4]
    batch = sequence_batch(items, times, np.arange(3), config.max_history)
    got = model(batch)
    assert batch.offsets.tolist() == [0, 4, 5, 11]  # the third user's latest 6 + 1 events: inputs 6, one target
    params = [{"w1": layer.uvqk, "w2": layer.out.weight.T, "b2": layer.out.bias, "pos_w": layer.pos_weights,
               "ts_w": layer.time_weights} for layer in model.stack.layers]
    params = [{k: v.detach().double() for k, v in p.items()} for p in params]
    for user, (ids, ts) in enumerate(zip(items, times)):
        ids, ts = torch.from_numpy(ids[-config.max_history - 1:]), torch.from_numpy(ts[-config.max_history - 1:])
        # the whole sequence, target included: row i queries at row i + 1's time; the target row is dropped
        x = (model.items.weight[ids].double() * math.sqrt(config.dim)
             + model.positions.weight[:ids.numel()].double())
        offsets = torch.tensor([0, ids.numel()])
        for p in params:
            x = reference.paper_stu_layer(x, offsets, ts, p, heads=2, qk_dim=4, v_dim=4, max_seq_len=config.width)
        expected = x[:-1] / x[:-1].norm(dim=-1, keepdim=True)
        start, end = int(batch.offsets[user]), int(batch.offsets[user + 1])
        torch.testing.assert_close(got[start:end].double(), expected, rtol=1e-5, atol=1e-5)
    assert config.width == 6 + 11  # the paper code's N: history cap + gr_output_length + 1


def test_a_ranking_model_refuses_the_retrieval_encoders_record() -> None:
    with pytest.raises(ValueError, match=r"^a checkpoint of --task retrieval, not of an HSTU ranking model"):
        HSTUConfig.from_dict(RetrievalConfig(item_rows=10).to_dict())
