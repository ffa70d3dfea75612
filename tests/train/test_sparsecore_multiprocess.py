"""``--engine sparsecore`` on two ranks through the CLI (torchrun's environment): lock-step
training with tables split table-wise over the ranks, and the checkpoint loads on one rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.train.conftest import TINY_OPTIONS, as_flags
from tests.train.conftest import REPO_ROOT
from tests.train.test_multiprocess import WORLD, _free_port
from torchrec_tpu.train.checkpoint import load_checkpoint
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.data import open_data
from torchrec_tpu.train.distributed import process_group
from torchrec_tpu.train.job import model_spec
from torchrec_tpu.train.metrics import evaluate
from torchrec_tpu.train.sparsecore_engine import build_dense_optimizer, build_sparsecore_model

STEPS = 24
CLI = "import sys; from torchrec_tpu import cli; sys.exit(cli.main(sys.argv[1:]))"


@pytest.fixture(scope="module")
def two_rank_sparsecore(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two fresh rank processes (not forked: this process has JAX running, and a forked JAX
    runtime deadlocks), each running the real CLI under torchrun's environment variables."""
    run_dir = tmp_path_factory.mktemp("two_ranks_sparsecore")
    log_dir = run_dir / "logs"
    argv = ["train", "--engine", "sparsecore", "--data", str(tiny_dataset), "--log-dir", str(log_dir),
            *as_flags({**TINY_OPTIONS, "max_steps": STEPS})]
    port = _free_port()
    outs = [run_dir / f"rank{rank}.out" for rank in range(WORLD)]
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        with open(outs[rank], "w") as out:
            procs.append(subprocess.Popen([sys.executable, "-c", CLI, *argv], env=env, stdout=out,
                                          stderr=subprocess.STDOUT, cwd=REPO_ROOT))
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, code in enumerate(codes):
        assert code == 0, f"rank {rank} exited with {code}:\n{outs[rank].read_text()[-3000:]}"
    return log_dir, [out.read_text() for out in outs]


@pytest.mark.multiprocess
def test_two_ranks_train_and_the_checkpoint_loads_on_one(two_rank_sparsecore) -> None:
    log_dir, (out0, _) = two_rank_sparsecore
    assert f"steps           {STEPS} ({STEPS * 256:,} samples this run, 2 rank(s))" in out0
    meta = json.loads((log_dir / "checkpoint" / "meta.json").read_text())
    assert meta["world_size"] == WORLD and meta["metrics"]["eval_auc"] > 0.55
    config = TrainConfig(**meta["config"])
    with process_group() as env, open_data(config, env) as data:
        spec = model_spec(config, data.schema.sparse, data.table_sizes, len(data.schema.dense))
        model = build_sparsecore_model(spec, env, torch.device("cpu"), config.sparse_optimizer,
                                       config.sparse_lr, config.batch_size, config.seed + 1)
        load_checkpoint(log_dir / "checkpoint", model,
                        build_dense_optimizer(model, config.dense_optimizer, config.dense_lr))
        reloaded = evaluate(model, data.held_out, torch.device("cpu"))
    # both ranks' table shards came back: the 1-rank model scores the held-out data alike
    assert reloaded.auc == pytest.approx(meta["metrics"]["eval_auc"], abs=2e-3)
