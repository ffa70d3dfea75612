"""``--sparse-backend auto``: the ops where the training step is one program that calls them
itself, the xla backend (in-place updates beside the step) everywhere else."""

from __future__ import annotations

import pytest
import torch

import torch_tpu  # noqa: F401  (registers the tpu device)
from sparsecore.optimizers import SGD, Adagrad, Adam
from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.engines.sparsecore_engine import resolve_sparse_backend

TPU, CPU = torch.device("tpu", 0), torch.device("cpu")


@pytest.mark.parametrize("optimizer,dense_device,world,parallel,expected", [
    (Adagrad(0.1), TPU, 1, "ddp", "ops"),
    (SGD(0.1), TPU, 1, "ddp", "ops"),
    (Adagrad(0.1), TPU, 2, "ddp", "xla"),  # several ranks: the towers run eagerly
    (Adagrad(0.1), CPU, 1, "ddp", "xla"),  # cpu towers: no step program
    (Adagrad(0.1), TPU, 1, "fsdp2", "xla"),
    (Adam(0.1), TPU, 1, "ddp", "xla"),  # Adam's bias corrections are host values per step
])
def test_auto_picks_ops_only_where_the_step_is_one_program(optimizer, dense_device, world, parallel, expected):
    assert resolve_sparse_backend("auto", optimizer, dense_device, world, parallel) == expected


@pytest.mark.parametrize("choice", ["ops", "xla"])
def test_an_explicit_backend_is_kept(choice):
    assert resolve_sparse_backend(choice, Adam(0.1), CPU, 2, "ddp") == choice


def test_the_default_is_auto_and_other_engines_refuse_a_backend():
    assert TrainConfig.from_options().engine.sparse_backend == "auto"
    with pytest.raises(ConfigError, match="--sparse-backend='ops' needs --engine"):
        TrainConfig.from_options(engine="torchrec", sparse_backend="ops")
