"""The learning-rate policy (TorchRec dlrm_main / MLPerf LRPolicyScheduler) against hand values,
applied to real optimizer param groups, and its flag checks."""

from __future__ import annotations

import pytest
import torch

from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.learning_rate import MIN_DECAYED_LR, LearningRates, LRPolicy


def test_policy_hand_values() -> None:
    policy = LRPolicy(warmup_steps=4, decay_start=6, decay_steps=4)
    got = [policy.lr(1.0, s) for s in range(1, 12)]
    want = [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 0.5625, 0.25, 0.0625, 0.0625, 0.0625]
    assert got == pytest.approx(want)
    assert LRPolicy().lr(0.3, 7) == 0.3 and LRPolicy().constant
    assert LRPolicy(decay_start=1, decay_steps=1).lr(1.0, 5) == 1.0  # (1/1)^2 held
    assert LRPolicy(decay_start=1, decay_steps=10**8).lr(1e-3, 10**8) == MIN_DECAYED_LR


def test_rates_are_set_on_both_optimizers_before_each_step() -> None:
    dense = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.2)
    sparse = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.4)
    pushed = []
    rates = LearningRates(LRPolicy(warmup_steps=2), dense.param_groups, 0.2, sparse.param_groups, 0.4,
                          push_sparse=lambda: pushed.append(sparse.param_groups[0]["lr"]))
    assert rates.at(1) == {"train/learning_rate/dense": 0.1, "train/learning_rate/sparse": 0.2}
    assert dense.param_groups[0]["lr"] == 0.1 and pushed == [0.2]
    rates.at(2)
    assert dense.param_groups[0]["lr"] == 0.2 and sparse.param_groups[0]["lr"] == 0.4


@pytest.mark.parametrize("options,message", [
    (dict(engine="torchrec", lr_warmup_steps=10, lr_decay_start=5, lr_decay_steps=3), "--lr-decay-start=5"),
    (dict(engine="sparsecore", lr_warmup_steps=10), "need --engine torchrec"),
    (dict(engine="torchrec", lr_decay_steps=-1), "--lr-decay-steps=-1"),
])
def test_bad_schedules_are_config_errors(options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**options)
