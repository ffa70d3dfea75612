"""``--engine sparsecore`` on two ranks through the CLI (torchrun's environment): lock-step
training with tables split table-wise over the ranks, and the checkpoint loads on one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.train.cli_ranks import WORLD, launch_cli_ranks
from tests.train.conftest import TINY_OPTIONS, as_flags, cpu_layout
from torchrec_tpu.train.checkpoint.store import load_checkpoint
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.data import open_data
from torchrec_tpu.train.distributed import process_group
from torchrec_tpu.train.engines.sparsecore_engine import build_dense_optimizer, build_sparsecore_model
from torchrec_tpu.train.job import model_spec
from torchrec_tpu.train.metrics import evaluate

STEPS = 24


@pytest.fixture(scope="module")
def two_rank_sparsecore(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("two_ranks_sparsecore")
    log_dir = run_dir / "logs"
    argv = ["train", "--data", str(tiny_dataset), "--log-dir", str(log_dir),
            *as_flags({**TINY_OPTIONS, "engine": "sparsecore", "max_steps": STEPS})]
    return log_dir, launch_cli_ranks(argv, run_dir)


@pytest.mark.multiprocess
def test_two_ranks_train_and_the_checkpoint_loads_on_one(two_rank_sparsecore) -> None:
    log_dir, (out0, _) = two_rank_sparsecore
    assert "collectives over one tpu_dist group of 2 ranks" in out0
    assert f"steps           {STEPS} ({STEPS * 256:,} samples this run, 2 rank(s))" in out0
    meta = json.loads((log_dir / "checkpoint" / "latest" / "meta.json").read_text())
    assert meta["world_size"] == WORLD and meta["metrics"]["eval_auc"] > 0.55
    config = TrainConfig.from_options(**meta["config"])
    with process_group() as env, open_data(config, env) as data:
        spec = model_spec(config, data.schema.sparse, data.table_sizes, len(data.schema.dense))
        model = build_sparsecore_model(spec, env, cpu_layout(config, env.world_size), config.optim, config.engine,
                                       config.data.batch_size, config.loop.seed + 1)
        load_checkpoint(log_dir / "checkpoint", model,
                        build_dense_optimizer(model, config.optim))
        reloaded = evaluate(model, data.held_out, torch.device("cpu"))
    # both ranks' table shards came back: the 1-rank model scores the held-out data alike
    assert reloaded.auc == pytest.approx(meta["metrics"]["eval_auc"], abs=2e-3)
