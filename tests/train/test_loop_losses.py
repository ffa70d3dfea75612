"""The training loop reads step losses lazily (every ``log_every`` steps, in one read), yet logs
the same means and stops on a NaN naming its step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torch_tpu  # noqa: F401  (the tpu device)
from torchrec_tpu.train.loop import LoopOptions, run_training
from torchrec_tpu.train.scalars import ScalarLog


class _Logistic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, batch: Batch):
        logits = self.linear(batch.dense_features).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def _batches(n: int) -> list[Batch]:
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.zeros(4, dtype=torch.long),
                                              lengths=torch.ones(4, dtype=torch.int32))
    return [Batch(dense_features=torch.full((4, 2), float(i)), sparse_features=kjt,
                  labels=torch.tensor([0.0, 1.0, 0.0, 1.0])) for i in range(n)]


class _Scripted:
    """A step function returning the given losses as tpu tensors (lazy, like the compiled step)."""

    def __init__(self, losses: list[float]) -> None:
        self.losses, self.calls = losses, 0

    def __call__(self, model, optimizer, batch) -> torch.Tensor:
        loss = torch.tensor(self.losses[self.calls]).to("tpu")
        self.calls += 1
        return loss


def _run(losses: list[float], log_every: int, tmp_path: Path):
    model = _Logistic()
    log = ScalarLog(tmp_path, enabled=False)
    logged: list[tuple[int, float]] = []
    original = log.log

    def record(step: int, scalars: dict[str, float]) -> None:
        if "train/loss" in scalars:
            logged.append((step, scalars["train/loss"]))
        original(step, scalars)

    log.log = record  # type: ignore[method-assign]
    options = LoopOptions(max_steps=len(losses), log_every=log_every, progress=False)
    result = run_training(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(len(losses)),
                          _batches(1), torch.device("cpu"), log, options, step_fn=_Scripted(losses))
    return result, logged


def test_logged_means_match_the_step_losses(tmp_path: Path) -> None:
    losses = [0.5, 0.25, 1.0, 2.0, 0.75, 0.125, 4.0]
    result, logged = _run(losses, log_every=3, tmp_path=tmp_path)
    assert [s for s, _ in logged] == [3, 6]
    assert logged[0][1] == pytest.approx(sum(losses[:3]) / 3)
    assert logged[1][1] == pytest.approx(sum(losses[3:6]) / 3)
    # the last log_every steps, the unlogged tail included
    assert result.final_train_loss == pytest.approx(sum(losses[4:]) / 3)
    assert result.steps == len(losses)


def test_nan_loss_stops_training_naming_its_step(tmp_path: Path) -> None:
    losses = [0.5, 0.25, math.nan, 2.0, 0.75, 0.125]
    with pytest.raises(FloatingPointError, match="NaN at step 2 "):
        _run(losses, log_every=4, tmp_path=tmp_path)


def test_target_auc_stops_at_the_first_evaluation_reaching_it(tmp_path: Path) -> None:
    def run(target: float):
        options = LoopOptions(max_steps=9, log_every=3, eval_every=3, target_auc=target, progress=False)
        return run_training(_Logistic(), torch.optim.SGD(_Logistic().parameters(), lr=0.1), _batches(9),
                            _batches(1), torch.device("cpu"), ScalarLog(tmp_path, enabled=False), options,
                            step_fn=_Scripted([0.5] * 9))

    assert run(0.4).steps == 3  # equal logits: AUC 0.5, over the target at the first evaluation (step 3)
    assert run(0.9).steps == 9  # never reached: all steps


def test_target_auc_flag_is_checked() -> None:
    from torchrec_tpu.train.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=r"--target-auc=0.8 needs --eval-every N"):
        TrainConfig.from_options(target_auc=0.8)
    with pytest.raises(ConfigError, match=r"--target-auc=1.5 must be in \[0, 1\)"):
        TrainConfig.from_options(target_auc=1.5, eval_every=10)
    assert TrainConfig.from_options(target_auc=0.80275, eval_every=10).loop.target_auc == 0.80275
