"""The training loop reads step losses lazily (every ``log_every`` steps, in one read), yet logs
the same means and stops on a NaN naming its step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import torch_tpu  # noqa: F401  (the tpu device)
from tests.train.scripted_loop import Logistic, ScriptedSteps, constant_batches
from torchrec_tpu.train.loop import LoopOptions, run_training
from torchrec_tpu.train.scalars import ScalarLog


def _run(losses: list[float], log_every: int, tmp_path: Path):
    model = Logistic()
    log = ScalarLog(tmp_path, enabled=False)
    logged: list[tuple[int, float]] = []
    original = log.log

    def record(step: int, scalars: dict[str, float]) -> None:
        if "train/loss" in scalars:
            logged.append((step, scalars["train/loss"]))
        original(step, scalars)

    log.log = record  # type: ignore[method-assign]
    options = LoopOptions(max_steps=len(losses), log_every=log_every, progress=False)
    result = run_training(model, torch.optim.SGD(model.parameters(), lr=0.1), constant_batches(len(losses)),
                          constant_batches(1), torch.device("cpu"), log, options, step_fn=ScriptedSteps(losses))
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
    with pytest.raises(FloatingPointError, match=r"NaN at step 3 \(epoch 0\)"):  # the third step, as logged
        _run(losses, log_every=4, tmp_path=tmp_path)


def test_target_auc_stops_at_the_first_evaluation_reaching_it(tmp_path: Path) -> None:
    def run(target: float):
        options = LoopOptions(max_steps=9, log_every=3, eval_every=3, target_auc=target, progress=False)
        return run_training(Logistic(), torch.optim.SGD(Logistic().parameters(), lr=0.1), constant_batches(9),
                            constant_batches(1), torch.device("cpu"), ScalarLog(tmp_path, enabled=False), options,
                            step_fn=ScriptedSteps([0.5] * 9))

    assert run(0.4).steps == 3  # equal logits: AUC 0.5, over the target at the first evaluation (step 3)
    assert run(0.9).steps == 9  # never reached: all steps


def test_target_auc_flag_is_checked() -> None:
    from torchrec_tpu.train.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=r"--target-auc=0.8 needs --eval-every N"):
        TrainConfig.from_options(target_auc=0.8)
    with pytest.raises(ConfigError, match=r"--target-auc=1.5 must be in \[0, 1\)"):
        TrainConfig.from_options(target_auc=1.5, eval_every=10)
    assert TrainConfig.from_options(target_auc=0.80275, eval_every=10).loop.target_auc == 0.80275
