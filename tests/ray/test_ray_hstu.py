"""``torchrec-tpu train --model hstu --ray-workers 2``: two Ray Train workers train HSTU as two
torchrun ranks do (each reads its rows of the window file), to the same checkpoint bit for bit,
and Ray keeps the run's checkpoint. Two CLI runs of worker start-ups on 2 loaded cores: slow."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipelines.sequences import synthetic_events, write_sequences
from tests.hstu.checkpoints import saved_state
from tests.train.cli_ranks import CLI, start_cli_ranks, wait_cli_ranks
from tests.train.conftest import REPO_ROOT

STEPS = 3


def _argv(data: Path, run: Path) -> list[str]:
    return ["train", "--model", "hstu", "--data", str(data), "--batch-size", "32", "--max-steps", str(STEPS),
            "--dense-device", "cpu", "--log-dir", str(run / "logs"), "--checkpoint-dir", str(run / "ckpt"),
            "--checkpoint-every", "2", "--no-progress"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ray_workers_train_hstu_as_torchrun_ranks(tmp_path: Path) -> None:
    data = tmp_path / "seq"
    write_sequences(synthetic_events(users=120, items=40, events_per_user=12, seed=1), data, windows=2,
                    max_history=10, candidates=2)
    torchrun = tmp_path / "torchrun"
    torchrun.mkdir()
    wait_cli_ranks(start_cli_ranks(_argv(data, torchrun), torchrun, 2), timeout=400)
    ray = tmp_path / "ray"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run([sys.executable, "-c", CLI, *_argv(data, ray), "--ray-workers", "2"], env=env,
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(rf"HSTU: {STEPS} steps .*\n  AUC \(window T\+1, \d+ candidates\): positive 0\.\d{{4}}",
                     done.stdout), done.stdout
    kept = re.search(r"ray checkpoint +(\S+)", done.stdout)
    assert kept and Path(kept[1]).name.startswith(f"checkpoint.step-{STEPS:08d}."), done.stdout
    assert (Path(kept[1]) / "meta.json").is_file() or (ray / kept[1] / "meta.json").is_file()
    (got, _), (expected, _) = (saved_state(run / "ckpt", tmp_path / "read" / run.name) for run in (ray, torchrun))
    assert set(got["model"]) == set(expected["model"])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

