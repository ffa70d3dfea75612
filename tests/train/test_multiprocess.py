"""Two ranks on loopback through the CLI entry point (torchrun's environment); resharding on load."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.train.conftest import TINY_OPTIONS, as_flags
from tests.train.test_job import _dense
from torchrec_tpu import cli
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


def _rank_main(rank: int, port: int, argv: list[str], out_path: Path) -> None:
    """One rank: torchrun's environment variables, then the real CLI entry point."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                       "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    with open(out_path, "w") as out, contextlib.redirect_stdout(out):
        code = cli.main(argv)
    sys.exit(code)


@pytest.fixture(scope="module")
def two_rank_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two forked ranks (they inherit the imported stack, so no per-rank import cost)."""
    run_dir = tmp_path_factory.mktemp("two_ranks")
    log_dir = run_dir / "logs"
    argv = ["train", "--data", str(tiny_dataset), "--log-dir", str(log_dir),
            *as_flags({**TINY_OPTIONS, "max_steps": STEPS})]
    port = _free_port()
    context = multiprocessing.get_context("fork")
    outs = [run_dir / f"rank{rank}.out" for rank in range(WORLD)]
    procs = [context.Process(target=_rank_main, args=(rank, port, argv, outs[rank]))
             for rank in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for rank, p in enumerate(procs):
        if p.is_alive():
            p.kill()
        assert p.exitcode == 0, f"rank {rank} exited with {p.exitcode}"
    return log_dir, [out.read_text() for out in outs]


@pytest.mark.multiprocess
def test_two_ranks_train_in_lock_step(two_rank_run) -> None:
    log_dir, (out0, out1) = two_rank_run
    assert "training finished" in out0 and "training finished" not in out1
    # Each rank steps on its half of every global batch of 256: 128 rows per rank per step.
    assert f"steps           {STEPS} ({STEPS * 256:,} samples this run, 2 rank(s))" in out0
    assert "8192 held-out rows" in out0  # the shards together cover the held-out file
    # Rank 0 has 4096 held-out rows, batches of 1024 / 2 = 512: none left; 8192 train rows, none.
    assert "left out" not in out0
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
