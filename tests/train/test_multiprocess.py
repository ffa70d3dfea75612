"""Two ranks on loopback through the real CLI (torchrun's environment), and resharding on load."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.train.conftest import REPO_ROOT, TINY_OPTIONS, as_flags
from tests.train.test_job import _dense
from torchrec_tpu.train.checkpoint import STATE_DIR, load_checkpoint
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.data import open_data
from torchrec_tpu.train.distributed import process_group
from torchrec_tpu.train.job import model_spec
from torchrec_tpu.train.model import build_dlrm
from torchrec_tpu.train.sharding import build_optimizer, shard_model

WORLD = 2
STEPS = 24  # lock-step and sharding are the point here, not learning (test_job covers that)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("two_ranks") / "logs"
    argv = [sys.executable, "-m", "torchrec_tpu.cli", "train", "--data", str(tiny_dataset),
            "--log-dir", str(log_dir), *as_flags({**TINY_OPTIONS, "max_steps": STEPS})]
    port = str(_free_port())
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(argv, cwd=REPO_ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [p.communicate(timeout=300) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
    return log_dir, [out for out, _ in outputs]


@pytest.mark.multiprocess
def test_two_ranks_train_in_lock_step(two_rank_run) -> None:
    log_dir, (out0, out1) = two_rank_run
    assert "training finished" in out0 and "training finished" not in out1
    # Each rank steps on its half of every global batch of 256: 128 rows per rank per step.
    assert f"steps           {STEPS} ({STEPS * 256:,} samples, 2 rank(s))" in out0
    assert "8192 held-out rows" in out0  # the shards together cover the held-out file
    meta = json.loads((log_dir / "checkpoint" / "meta.json").read_text())
    assert meta["world_size"] == WORLD and meta["step"] == STEPS
    assert meta["metrics"]["eval_auc"] > 0.55
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1  # rank 0 only


@pytest.mark.multiprocess
def test_two_rank_checkpoint_loads_on_one_rank(two_rank_run, tmp_path: Path) -> None:
    log_dir, _ = two_rank_run
    flat = tmp_path / "flat.pt"
    dcp_to_torch_save(log_dir / "checkpoint" / STATE_DIR, flat)
    saved = torch.load(flat, weights_only=False)["model"]
    meta = json.loads((log_dir / "checkpoint" / "meta.json").read_text())
    config = TrainConfig(**meta["config"])
    with process_group() as env, open_data(config, env) as data:
        assert env.world_size == 1
        spec = model_spec(config, data.schema.sparse, data.table_sizes, len(data.schema.dense))
        model = shard_model(build_dlrm(spec, torch.device("cpu")), env, torch.device("cpu"),
                            config.sparse_optimizer, config.sparse_lr, config.batch_size)
        load_checkpoint(log_dir / "checkpoint", model,
                        build_optimizer(model, config.dense_optimizer, config.dense_lr))
        for name, value in model.state_dict().items():
            assert torch.equal(_dense(value), saved[name]), name
