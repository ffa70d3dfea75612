"""``--engine sparsecore`` on two ranks through the CLI (torchrun's environment): lock-step
training with tables split table-wise over the ranks, and the checkpoint loads on one rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.train.cli_ranks import WORLD, latest_meta, on_one_rank, train_on_ranks
from tests.train.conftest import cpu_layout
from torchrec_tpu.train.checkpoint.store import load_checkpoint
from torchrec_tpu.train.engines.sparsecore_engine import build_dense_optimizer, build_sparsecore_model
from torchrec_tpu.train.metrics import evaluate

STEPS = 24


@pytest.fixture(scope="module")
def two_rank_sparsecore(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory):
    return train_on_ranks(tiny_dataset, tmp_path_factory.mktemp("two_ranks_sparsecore"), engine="sparsecore",
                          max_steps=STEPS)


@pytest.mark.multiprocess
def test_two_ranks_train_and_the_checkpoint_loads_on_one(two_rank_sparsecore) -> None:
    log_dir, (out0, _) = two_rank_sparsecore
    assert "collectives over one tpu_dist group of 2 ranks" in out0
    assert f"steps           {STEPS} ({STEPS * 256:,} samples this run, 2 rank(s))" in out0
    meta = latest_meta(log_dir)
    assert meta["world_size"] == WORLD and meta["metrics"]["eval_auc"] > 0.55
    with on_one_rank(log_dir) as (config, env, data, spec):
        model = build_sparsecore_model(spec, env, cpu_layout(config, env.world_size), config.optim, config.engine,
                                       config.data.batch_size, config.loop.seed + 1)
        load_checkpoint(log_dir / "checkpoint", model,
                        build_dense_optimizer(model, config.optim, torch.device("cpu")))
        reloaded = evaluate(model, data.held_out, torch.device("cpu"))
    # both ranks' table shards came back: the 1-rank model scores the held-out data alike
    assert reloaded.auc == pytest.approx(meta["metrics"]["eval_auc"], abs=2e-3)
