"""``--sparse-backend``: every name of ``sparsecore.backends`` is a choice; ``auto`` resolves to
the ops where the training step is one program that calls them itself, the xla backend (in-place
updates beside the step) everywhere else."""

from __future__ import annotations

import argparse

import pytest
import torch

import torch_tpu  # noqa: F401  (registers the tpu device)
from sparsecore.backends import BACKENDS
from tests.train.dense_device_checks import STEPS, train
from torchrec_tpu.train.cli import add_arguments
from torchrec_tpu.train.config import ConfigError, EngineConfig, OptimConfig, TrainConfig, config_from_args
from torchrec_tpu.train.engines.dense_placement import tpu_installed
from torchrec_tpu.train.engines.step_layout import sparsecore_layout

TPU, CPU = torch.device("tpu", 0), torch.device("cpu")


def _layout(optimizer: str, dense_device: torch.device, world: int, parallel: str = "ddp", backend: str = "auto"):
    return sparsecore_layout(EngineConfig(dense_parallel=parallel, sparse_backend=backend),
                             OptimConfig(sparse_optimizer=optimizer), world, 64, dense_device)


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


@pytest.mark.parametrize("choice", ["ops", "xla", "fbgemm"])
def test_an_explicit_backend_is_kept(choice):
    assert _layout("sgd", CPU, 2, backend=choice).sparse_backend == choice


def test_the_default_is_auto_and_other_engines_refuse_a_backend():
    assert TrainConfig.from_options().engine.sparse_backend == "auto"
    with pytest.raises(ConfigError, match="--sparse-backend='ops' needs --engine"):
        TrainConfig.from_options(engine="torchrec", sparse_backend="ops")


def test_the_flag_offers_auto_and_every_registered_backend():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (action,) = [a for a in parser._actions if "--sparse-backend" in a.option_strings]
    assert tuple(action.choices) == ("auto", *BACKENDS) and set(BACKENDS) == {"xla", "fbgemm", "tpu", "ops"}
    for name in ("fbgemm", "tpu"):  # once unreachable from the CLI
        assert config_from_args(parser.parse_args(["--engine", "sparsecore", "--sparse-backend", name])
                                ).engine.sparse_backend == name


def test_fbgemm_trains_like_xla():
    """``--sparse-backend fbgemm``: the same DLRM trained on FBGEMM's TBE kernels follows the xla
    backend's losses and tables (FBGEMM's Adagrad adds an epsilon the SparseCore kernel has not:
    5e-7 apart after 4 steps, measured)."""
    xla, fbgemm = train("cpu", sparse_backend="xla"), train("cpu", sparse_backend="fbgemm")
    assert len(fbgemm["losses"]) == STEPS
    torch.testing.assert_close(fbgemm["losses"], xla["losses"], rtol=0, atol=1e-6)
    for name, value in xla["state"].items():
        torch.testing.assert_close(fbgemm["state"][name], value, rtol=0, atol=5e-6, msg=name)
    tables = [k for k in fbgemm["state"] if k.startswith("table.")]
    assert tables and all(not torch.equal(fbgemm["state"][k], fbgemm["initial"][k]) for k in tables)


@pytest.mark.skipif(tpu_installed(), reason="a TPU host runs the tpu backend")
def test_tpu_is_refused_off_a_tpu_host_before_any_table_is_built():
    with pytest.raises(ConfigError, match="--sparse-backend='tpu' runs jax-tpu-embedding's SparseCore kernels, "
                                          "which only a TPU host executes .*--sparse-backend='xla' computes the same"):
        _layout("sgd", CPU, 1, backend="tpu")
