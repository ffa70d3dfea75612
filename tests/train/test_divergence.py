"""The divergence guard: a non-finite loss, or one grown 100x over the first step's, stops training
in one line naming the step, the loss and the learning rates, on every rank at once; a run that
does not diverge is untouched."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.train.conftest import TINY_OPTIONS, as_flags
from tests.train.scripted_loop import Logistic, ScriptedSteps, constant_batches
from torchrec_tpu.cli import main
from torchrec_tpu.train.divergence import DivergenceGuard, TrainingDiverged
from torchrec_tpu.train.loop import LoopOptions, run_training
from torchrec_tpu.train.scalars import ScalarLog


def _run(losses: list[float], log_every: int, tmp_path: Path, rates: str = "") -> int:
    options = LoopOptions(max_steps=len(losses), log_every=log_every, progress=False, learning_rates=rates)
    model = Logistic()
    result = run_training(model, torch.optim.SGD(model.parameters(), lr=0.1), constant_batches(len(losses)),
                          constant_batches(1), torch.device("cpu"), ScalarLog(tmp_path, enabled=False), options,
                          step_fn=ScriptedSteps(losses))
    return result.steps


def test_an_exploding_loss_stops_the_loop_naming_step_loss_and_rates(tmp_path: Path) -> None:
    losses = [0.69, 0.7, 3.0, 70.0, 1.8e22, 0.5]  # 70.0 is 101x the first step's 0.69
    with pytest.raises(TrainingDiverged) as raised:
        _run(losses, log_every=5, tmp_path=tmp_path, rates="--sparse-lr 5 (sgd), --dense-lr 5 (sgd)")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("training loss is 70 at step 4 (epoch 0), over 100x the first step's 0.69 "
                              "(learning rates: --sparse-lr 5 (sgd), --dense-lr 5 (sgd))"), message


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_loss_stops_the_loop(tmp_path: Path, bad: float) -> None:
    with pytest.raises(TrainingDiverged, match=r"at step 2 \(epoch 0\), not finite"):
        _run([0.5, bad, 0.4], log_every=3, tmp_path=tmp_path)


def test_losses_that_wander_but_do_not_explode_train_on(tmp_path: Path) -> None:
    # 68x the first loss, then down again: not two orders of magnitude
    assert _run([0.5, 34.0, 0.01, 20.0, 0.3], log_every=2, tmp_path=tmp_path) == 5


def test_the_guard_is_checked_at_the_end_too(tmp_path: Path) -> None:
    """The steps after the last log are read at the end: a divergence there still fails the run."""
    with pytest.raises(TrainingDiverged, match="at step 5"):
        _run([0.5, 0.5, 0.5, 0.5, 500.0], log_every=4, tmp_path=tmp_path)


def _rank(rank: int, world_size: int, store_path: str, losses: list[list[float]], out: str) -> None:
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    guard = DivergenceGuard("--sparse-lr 1", world_size)
    try:
        guard.check([(1, 0, losses[rank][0])])  # every rank fine
        guard.check([(step, 0, loss) for step, loss in enumerate(losses[rank][1:], start=2)])
        message = "no error"
    except TrainingDiverged as error:
        message = str(error)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.txt").write_text(message)


def test_all_ranks_stop_together_with_the_flagged_ranks_line(tmp_path: Path) -> None:
    losses = [[0.6, 0.7, 0.8], [0.7, 0.7, math.nan], [0.6, 0.6, 0.6]]  # only rank 1 sees NaN (at step 3)
    mp.start_processes(_rank, args=(3, str(tmp_path / "store"), losses, str(tmp_path)), nprocs=3, join=True,
                       start_method="fork")
    lines = {Path(tmp_path, f"rank{r}.txt").read_text() for r in range(3)}
    assert lines == {"rank 1: training loss is NaN at step 3 (epoch 0), not finite (learning rates: --sparse-lr 1): "
                     "training diverged; lower the learning rate"}


@pytest.mark.parametrize("engine", ["torchrec", pytest.param("sparsecore", marks=pytest.mark.slow)])
def test_dlrm_mains_learning_rate_line_trains_sgd_and_its_divergence_exits_in_one_line(
        tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture, engine: str) -> None:
    """TorchRec's ``--learning_rate`` without ``--adagrad`` is SGD (dlrm_main's optimizer); at a rate
    SGD cannot take the run stops at once with one error line, exit 2, instead of ending at AUC 0.5."""
    options = {k: v for k, v in TINY_OPTIONS.items() if k not in ("sparse_lr", "dense_lr", "engine")}
    rc = main(["train", "--data", str(tiny_dataset), "--log-dir", str(tmp_path / "run"), *as_flags(options),
               "--engine", engine, "--learning_rate", "1000", "--log-every", "1", "--max-steps", "6"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(errors) == 1, errors
    assert errors[0].startswith("torchrec-tpu train: error: training loss is "), errors
    assert "at step 2 (epoch 0), over 100x the first step's" in errors[0]
    assert "(learning rates: --sparse-lr 1000 (sgd), --dense-lr 1000 (sgd))" in errors[0]
