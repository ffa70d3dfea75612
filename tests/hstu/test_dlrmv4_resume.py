"""``train --model dlrmv4`` checkpoints and resumes exactly, on one rank and on two (the tables
sharded by TorchRec's planner, the rest in DDP), its warmup reaches the tables' fused optimizer,
and ``profile`` steps it. The checkpoints are read with stock torch.distributed.checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hstu.checkpoints import saved_state
from tests.hstu.dlrmv4_ranks import train

# 2 days of 3 batches of 8, evaluation on 2 batches; warming up over the first 4 steps
OPTIONS = {"batch_size": 8, "eval_batch_size": 8, "epochs": 2, "limit_train_batches": 3, "limit_val_batches": 2,
           "eval_every": 2, "dense_lr": 1e-3, "sparse_lr": 1e-2, "lr_warmup_steps": 4}


def _options(run: Path, **more: object) -> dict:
    return {**OPTIONS, "log_dir": str(run / "tb"), "checkpoint_dir": str(run / "ckpt"), **more}


def _assert_same_state(a: Path, b: Path, scratch: Path) -> None:
    (state_a, meta_a), (state_b, meta_b) = (saved_state(run / "ckpt", scratch / run.name) for run in (a, b))
    assert meta_a["step"] == meta_b["step"] == 6 and meta_a["row"] == meta_b["row"]
    flat_a, flat_b = (dict(_leaves(s)) for s in (state_a, state_b))
    assert flat_a.keys() == flat_b.keys()
    assert any("embeddings" in k and "momentum" in k for k in flat_a), sorted(flat_a)[:20]  # the fused state
    for key, value in flat_a.items():
        assert torch.equal(value, flat_b[key]), key


def _leaves(state: object, prefix: str = ""):
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _leaves(value, f"{prefix}{key}/")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _leaves(value, f"{prefix}{i}/")
    elif isinstance(state, torch.Tensor):
        yield prefix, state


@pytest.mark.slow
def test_a_resumed_run_ends_where_a_straight_one_does(tmp_path: Path) -> None:
    """6 steps straight, or 3 (mid-warmup, mid-day), a checkpoint and a resume: the same tables,
    fused optimizer state, dense weights, Adam moments and evaluation, bit for bit."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    said = train(_options(straight))
    train(_options(split, max_steps=3))
    resumed = train(_options(split, resume=str(split / "ckpt")))
    assert said.splitlines()[1] == resumed.splitlines()[1], (said, resumed)  # the evaluation line
    _assert_same_state(straight, split, tmp_path / "read")


@pytest.mark.slow
def test_the_warmup_reaches_the_fused_tables(tmp_path: Path) -> None:
    """Step 1 of a 2-step warmup runs at half the rates: the tables (updated inside backward by
    FBGEMM's kernel) and the dense weights end as a run at half the rates without warmup."""
    half = {"dense_lr": OPTIONS["dense_lr"] / 2, "sparse_lr": OPTIONS["sparse_lr"] / 2}
    states = {}
    for name, more in (("warm", {"lr_warmup_steps": 2}), ("half", {**half, "lr_warmup_steps": 0}),
                       ("full", {"lr_warmup_steps": 0})):
        train(_options(tmp_path / name, max_steps=1, **more))
        states[name] = saved_state(tmp_path / name / "ckpt", tmp_path / "read" / name)[0]["model"]
    tables = [k for k in states["warm"] if k.startswith("model.embeddings.")]
    assert len(tables) == 11, sorted(states["warm"])
    for key, value in states["warm"].items():
        assert torch.equal(value, states["half"][key]), key
    assert not any(torch.equal(states["warm"][k], states["full"][k]) for k in tables)  # the rate acts


def _two_ranks(options: dict) -> str:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(Path(__file__).with_name("dlrmv4_ranks.py")), json.dumps(options)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_shard_the_tables_and_resume_exactly(tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    said = _two_ranks(_options(straight))
    assert said.startswith("DLRMv4: 6 steps") and "eval (day T+1, 16 anchors)" in said, said
    _two_ranks(_options(split, max_steps=3))
    assert _two_ranks(_options(split, resume=str(split / "ckpt"))).splitlines()[1] == said.splitlines()[1]
    _assert_same_state(straight, split, tmp_path / "read")
    _, meta = saved_state(straight / "ckpt", tmp_path / "read" / "c")
    assert meta["world_size"] == 2 and meta["row"] == 6 * 4  # each rank's rows: 6 batches of 4


@pytest.mark.slow
def test_profile_traces_the_setup_and_step_train_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``profile --model dlrmv4`` traces the registry's setup and step (here at the test's size:
    the setup's default sizes are the full model's)."""
    from tests.hstu.dlrmv4_ranks import SMALL, WORLD
    from torchrec_tpu.hstu import dlrmv4_training
    from torchrec_tpu.profiling.job import profile_training
    from torchrec_tpu.train.config import TrainConfig

    monkeypatch.setattr(dlrmv4_training.dlrmv4_training.__wrapped__, "__defaults__", (SMALL, WORLD))
    config = TrainConfig.from_options(model="dlrmv4", batch_size=8, limit_train_batches=1, progress=False)
    result = profile_training(config, steps=2, warmup=1, log_dir=tmp_path / "profile")
    summary = result.format()
    assert "profile of 2 training steps" in summary and "engine          torchrec" in summary, summary
    trace = next(tmp_path.joinpath("profile").rglob("*.trace.json"))
    assert "FusedEmbedding" in trace.read_text() or "embedding" in trace.read_text().lower()
