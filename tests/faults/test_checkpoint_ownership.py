"""A run never deletes checkpoints it did not write: a new run is refused a checkpoint root that
holds another run's checkpoints (unless --resume or --overwrite-checkpoints, which keeps them),
and two jobs never share a log or checkpoint directory (a lock naming the holder, released when
the holder dies)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.checkpoint_helpers import BATCH, REPO_ROOT, run_cli, run_copy, train_args, versions  # noqa: F401
from tests.faults.conftest import TRAIN_FLAGS
from tests.faults.helpers import assert_clean_error
from torchrec_tpu.train.checkpoint.dir_lock import LOCK_FILE, locked
from torchrec_tpu.train.checkpoint.dirs import LATEST, publish, run_id_of, start_version, version_dir


def _another_runs_root(root: Path) -> list[Path]:
    """Two published checkpoints of run "other-run" in ``root`` (hand-made: no training)."""
    for step in (2, 4):
        directory = version_dir(root, step, f"t{step}")
        start_version(directory, "other-run")
        (directory / "state").mkdir()
        (directory / "state" / "weights").write_bytes(b"precious")
        publish(root, directory, {"step": step}, keep=2)
    return versions(root)


def test_a_new_run_is_refused_a_checkpoint_dir_holding_another_runs_checkpoints(tiny_dataset, tmp_path):
    root = tmp_path / "theirs"
    theirs = _another_runs_root(root)
    refused = run_cli("train", "--data", str(tiny_dataset), *TRAIN_FLAGS, "--log-dir", str(tmp_path / "new"),
                      "--checkpoint-dir", str(root))
    assert_clean_error(refused.returncode, refused.stderr, f"--checkpoint-dir={str(root)!r} holds another run's",
                       f"run other-run: 2 checkpoint(s), the newest {theirs[-1].name}", f"--resume {root}",
                       "--overwrite-checkpoints")
    assert versions(root) == theirs and os.readlink(root / LATEST) == theirs[-1].name
    assert all((p / "state" / "weights").read_bytes() == b"precious" for p in theirs)


@pytest.mark.slow  # trains 6 steps into a real run's root (~70 s on 2 busy cores)
def test_overwrite_checkpoints_starts_a_new_run_there_and_keeps_theirs(run_copy, tmp_path: Path) -> None:
    data, root = run_copy
    theirs = versions(root)
    owner = run_id_of(theirs[-1])
    done = run_cli(*train_args(data, tmp_path / "new", "--batch-size", str(BATCH), "--max-steps", "6",
                               "--checkpoint-every", "2", "--checkpoint-dir", str(root), "--overwrite-checkpoints",
                               "--keep-checkpoints", "1"))
    assert done.returncode == 0, done.stderr[-3000:]
    ours = [p for p in versions(root) if p not in theirs]
    assert all(p.is_dir() for p in theirs), "another run's checkpoints were deleted"
    assert len(ours) == 1 and run_id_of(ours[0]) not in (None, owner)  # its own older ones pruned
    assert os.readlink(root / LATEST) == ours[0].name


@pytest.mark.slow  # resumes a real run for 4 steps (~30 s on 2 busy cores)
def test_a_resumed_run_prunes_the_checkpoints_of_the_run_it_continues(run_copy, tmp_path: Path) -> None:
    data, root = run_copy
    before = versions(root)
    owner = run_id_of(before[-1])
    done = run_cli(*train_args(data, tmp_path / "resumed", "--batch-size", str(BATCH), "--max-steps", "8",
                               "--checkpoint-every", "2", "--checkpoint-dir", str(root), "--resume", str(root)))
    assert done.returncode == 0, done.stderr[-3000:]
    after = versions(root)
    assert len(after) == 2 and not set(before) & set(after)  # the kept two are the resumed run's newest
    assert {run_id_of(p) for p in after} == {owner}


def _hold_lock(directory: Path) -> subprocess.Popen:
    """Another process holding ``directory``'s lock as a running job does, until killed."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from torchrec_tpu.train.checkpoint.dir_lock import locked\n"
         "with locked(Path(sys.argv[1]), 'a job'):\n    print('held', flush=True); time.sleep(600)",
         str(directory)],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("flag", ["--log-dir", "--checkpoint-dir"])
def test_a_second_job_on_a_directory_is_refused_naming_the_holder_until_it_dies(tiny_dataset, tmp_path, flag):
    held = tmp_path / "shared"
    args = ["train", "--data", str(tiny_dataset), *TRAIN_FLAGS, "--log-dir", str(tmp_path / "run"), flag, str(held)]
    holder = _hold_lock(held)
    try:
        started = time.monotonic()
        refused = run_cli(*args)
        assert_clean_error(refused.returncode, refused.stderr, f"{flag}={str(held)!r} is in use by another",
                           f"pid {holder.pid} on host {socket.gethostname()}", str(held / LOCK_FILE))
        assert time.monotonic() - started < 60, "refusing must not wait"  # it comes before any data or model
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (held / LOCK_FILE).exists()  # the dead holder's lock file stays; its flock is gone
    with locked(held, flag):
        assert json.loads((held / LOCK_FILE).read_text())["pid"] == os.getpid()
