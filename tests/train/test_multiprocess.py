"""Two ranks on loopback through the CLI entry point (torchrun's environment); resharding on load."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Iterator

import pyarrow.parquet as pq
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.train.cli_ranks import WORLD, latest_meta, on_one_rank, train_on_ranks
from tests.train.conftest import whole_tensor
from torchrec_tpu.train.checkpoint.store import STATE_DIR, load_checkpoint
from torchrec_tpu.train.data import TrainData
from torchrec_tpu.train.engines.torchrec_engine import build_optimizer, shard_model
from torchrec_tpu.train.metrics import evaluate
from torchrec_tpu.train.model import build_dlrm

STEPS = 24  # lock-step and sharding are the point here, not learning (test_job covers that)



HELD_OUT_ROWS = 5001  # 2500 rows on rank 0, 2501 on rank 1: in batches of 500, one batch more


@pytest.fixture(scope="module")
def odd_held_out_dataset(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dataset with its held-out file cut to HELD_OUT_ROWS rows."""
    out = tmp_path_factory.mktemp("odd_held_out")
    *train, held_out = sorted(tiny_dataset.glob("*.parquet"))
    for path in train:
        shutil.copy(path, out)
    pq.write_table(pq.read_table(held_out).slice(0, HELD_OUT_ROWS), out / held_out.name)
    return out


@pytest.fixture(scope="module")
def two_rank_run(odd_held_out_dataset: Path, tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("two_ranks")
    # DLRM_DCN with MLPerf's log: both ranks are given the same --mllog path, rank 0 alone writes it
    return train_on_ranks(odd_held_out_dataset, run_dir, max_steps=STEPS, eval_batch_size=1000, model="dlrm_dcn",
                          dcn_low_rank_dim=4, mllog=str(run_dir / "logs" / "result_0.txt"))


@pytest.mark.multiprocess
def test_two_ranks_train_in_lock_step(two_rank_run) -> None:
    log_dir, (out0, out1) = two_rank_run
    assert "training finished" in out0 and "training finished" not in out1
    # one tpu_dist group (DMP's all_to_alls, DDP, DCP); nothing on tpu: no JAX coordinator joined
    assert "collectives over one tpu_dist group of 2 ranks: tpu tensors by the gloo transport" in out0
    # Each rank steps on its half of every global batch of 256: 128 rows per rank per step.
    assert f"steps           {STEPS} ({STEPS * 256:,} samples this run, 2 rank(s))" in out0
    assert f"{HELD_OUT_ROWS:,} held-out rows" in out0  # the shards together cover the held-out file
    assert "left out" not in out0  # 8192 train rows per rank, batches of 128: none left
    meta = latest_meta(log_dir)
    assert meta["world_size"] == WORLD and meta["step"] == STEPS
    assert meta["metrics"]["eval_auc"] > 0.55
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1  # rank 0 only
    mllog = [json.loads(line.split(" ", 1)[1]) for line in (log_dir / "result_0.txt").read_text().splitlines()]
    assert [line["key"] for line in mllog].count("run_start") == 1  # rank 0 only
    values = {line["key"]: line["value"] for line in mllog}
    assert values["train_samples"] == 2 * 8192 and values["eval_samples"] == HELD_OUT_ROWS  # every rank's rows
    assert values["eval_accuracy"] == pytest.approx(meta["metrics"]["eval_auc"])


@contextlib.contextmanager
def one_rank_copy(log_dir: Path) -> Iterator[tuple[nn.Module, TrainData]]:
    """The torchrec-engine model of ``log_dir``'s latest checkpoint loaded on one rank, and its run's data."""
    with on_one_rank(log_dir) as (config, env, data, spec):
        model = shard_model(build_dlrm(spec, torch.device("cpu")), env, torch.device("cpu"), config.optim,
                            config.data.batch_size)
        load_checkpoint(log_dir / "checkpoint", model,
                        build_optimizer(model, config.optim))
        yield model, data


@pytest.mark.multiprocess
def test_two_rank_checkpoint_loads_on_one_rank(two_rank_run, tmp_path: Path) -> None:
    log_dir, _ = two_rank_run
    flat = tmp_path / "flat.pt"
    dcp_to_torch_save(log_dir / "checkpoint" / "latest" / STATE_DIR, flat)
    saved = torch.load(flat, weights_only=False)["model"]
    with one_rank_copy(log_dir) as (model, _):
        for name, value in model.state_dict().items():
            assert torch.equal(whole_tensor(value), saved[name]), name


@pytest.mark.multiprocess
def test_two_ranks_score_every_held_out_row(two_rank_run) -> None:
    log_dir, (out0, _) = two_rank_run
    assert f"{HELD_OUT_ROWS:,} samples)" in out0
    assert "Warning" not in out0  # torchmetrics' gather of the ranks' unequal prediction counts is quiet
    metrics = latest_meta(log_dir)["metrics"]
    with one_rank_copy(log_dir) as (model, data):
        reference = evaluate(model, data.held_out, torch.device("cpu"))  # one rank, no padding
    assert reference.samples == HELD_OUT_ROWS
    assert metrics["eval_auc"] == pytest.approx(reference.auc, abs=1e-6)
    assert metrics["eval_loss"] == pytest.approx(reference.loss, rel=1e-6)
