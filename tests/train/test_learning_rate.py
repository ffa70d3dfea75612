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
        TrainConfig.from_options(**options)


def test_scheduled_rate_reaches_both_optimizers_of_the_torchrec_engine(tiny_dataset, tmp_path) -> None:
    """One step at warm-up rate base/2 ends where one step at the constant rate base/2 ends:
    FBGEMM's fused embedding update and the dense optimizer both used the scheduled rate."""
    from tests.train.conftest import flat_checkpoint, tiny_config
    from torchrec_tpu.train.job import run_job

    runs = {}
    for name, options in (("scheduled", dict(sparse_lr=0.2, dense_lr=0.1, lr_warmup_steps=2)),
                          ("constant", dict(sparse_lr=0.1, dense_lr=0.05))):
        config = tiny_config(tiny_dataset, tmp_path / name, max_steps=1, sparse_optimizer="sgd", **options)
        runs[name] = flat_checkpoint(run_job(config).checkpoint_dir, tmp_path / f"{name}.pt")
    scheduled, constant = runs["scheduled"], runs["constant"]
    weights = [k for k in constant if k.startswith("model.") and isinstance(constant[k], torch.Tensor)]
    assert any("embedding_bags" in k for k in weights) and any("over_arch" in k for k in weights)
    for key in weights:
        torch.testing.assert_close(_local(scheduled[key]), _local(constant[key]), msg=key)


def _local(value):
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return value.local_shards()[0].tensor if isinstance(value, ShardedTensor) else value
