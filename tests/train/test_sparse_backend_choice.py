"""``--sparse-backend auto``: the ops where the training step is one program that calls them
itself, the xla backend (in-place updates beside the step) everywhere else."""

from __future__ import annotations

import pytest
import torch

import torch_tpu  # noqa: F401  (registers the tpu device)
from torchrec_tpu.train.config import ConfigError, EngineConfig, OptimConfig, TrainConfig
from torchrec_tpu.train.engines.step_layout import sparsecore_layout

TPU, CPU = torch.device("tpu", 0), torch.device("cpu")


def _layout(optimizer: str, dense_device: torch.device, world: int, parallel: str = "ddp", backend: str = "auto"):
    return sparsecore_layout(EngineConfig(dense_parallel=parallel, sparse_backend=backend),
                             OptimConfig(sparse_optimizer=optimizer), world, dense_device)


@pytest.mark.parametrize("optimizer,dense_device,world,parallel,expected", [
    ("adagrad", TPU, 1, "ddp", "ops"),
    ("sgd", TPU, 1, "ddp", "ops"),
    ("adagrad", TPU, 2, "ddp", "xla"),  # several ranks: the towers run eagerly
    ("adagrad", CPU, 1, "ddp", "xla"),  # cpu towers: no step program
    ("adagrad", TPU, 1, "fsdp2", "xla"),
    ("rowwise_adagrad", TPU, 1, "ddp", "ops"),
])
def test_auto_picks_ops_only_where_the_step_is_one_program(optimizer, dense_device, world, parallel, expected):
    layout = _layout(optimizer, dense_device, world, parallel)
    assert layout.sparse_backend == expected
    assert layout.one_program == (dense_device == TPU and world == 1 and parallel == "ddp")
    assert not layout.uniform_ranks  # one rank, or no step program


@pytest.mark.parametrize("choice", ["ops", "xla"])
def test_an_explicit_backend_is_kept(choice):
    assert _layout("sgd", CPU, 2, backend=choice).sparse_backend == choice


def test_the_default_is_auto_and_other_engines_refuse_a_backend():
    assert TrainConfig.from_options().engine.sparse_backend == "auto"
    with pytest.raises(ConfigError, match="--sparse-backend='ops' needs --engine"):
        TrainConfig.from_options(engine="torchrec", sparse_backend="ops")
