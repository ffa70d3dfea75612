"""A failure or a stop is said once and says what to do next: at several ranks a user error is
one line from the first rank that saw it (not one per rank), and Ctrl-C or SIGTERM after a
checkpoint says how to resume from it (the command resumed that way continues)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.faults.conftest import TRAIN_FLAGS
from tests.faults.helpers import cli_command, cli_env, error_lines
from tests.train.cli_ranks import TAIL, finish_cli_ranks, start_cli_ranks


def _as_rank_of_job(monkeypatch: pytest.MonkeyPatch, port: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", uuid.uuid4().hex)


def _claims(times: int) -> list[bool]:
    """``claim_report()`` called ``times`` times in a fresh process (a rank: a child of this one,
    as ranks are children of their launcher), with this process's environment."""
    code = ("import json; from torchrec_tpu.rank_report import claim_report; "
            f"print(json.dumps([claim_report() for _ in range({times})]))")
    out = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_first_rank_of_a_job_claims_the_report_and_another_job_has_its_own(monkeypatch):
    _as_rank_of_job(monkeypatch, "29500")
    assert _claims(2) == [True, True]  # the first rank, asking again (it runs a second command)
    assert _claims(1) == [False]  # another rank of the same job
    _as_rank_of_job(monkeypatch, "29500")  # the next job on the same port: a new run id
    assert _claims(1) == [True]


@pytest.mark.multiprocess
@pytest.mark.parametrize("argv, fragment", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),  # argparse, before the imports
    (["--batch-size", "63"], "--batch-size"),  # not split evenly over 2 ranks: refused on each rank
])
def test_a_user_error_every_rank_sees_is_said_once(tiny_dataset, tmp_path, argv, fragment):
    flags = [f for f in TRAIN_FLAGS if f not in ("--batch-size", "64")]
    ranks = start_cli_ranks(["train", "--data", str(tiny_dataset), *flags, "--log-dir", str(tmp_path / "run"),
                             *argv], tmp_path / "ranks")
    codes = finish_cli_ranks(ranks, timeout=240)
    outputs = [out.read_text() for _, out in ranks]
    assert codes == [2, 2], [o[-TAIL:] for o in outputs]
    (line,) = [line for output in outputs for line in error_lines(output)]
    assert fragment in line, line


def _train_until_a_checkpoint(tiny_dataset: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    root = tmp_path / "run" / "checkpoint"
    flags = [f for f in TRAIN_FLAGS if f not in ("--max-steps", "2")]
    proc = subprocess.Popen(cli_command("train", "--data", str(tiny_dataset), *flags, "--epochs", "100000",
                                        "--log-dir", str(tmp_path / "run"), "--checkpoint-every", "2"),
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (root / "latest").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if not (root / "latest").exists():
        proc.kill()
        pytest.fail(f"no checkpoint: {proc.communicate()[1][-TAIL:]}")
    return proc, root


@pytest.mark.slow
@pytest.mark.parametrize("sig, why, rc", [(signal.SIGINT, "interrupted", 130),
                                          (signal.SIGTERM, "stopped by SIGTERM", 128 + signal.SIGTERM)])
def test_a_stop_after_a_checkpoint_says_how_to_resume(tiny_dataset, tmp_path, sig, why, rc):
    proc, root = _train_until_a_checkpoint(tiny_dataset, tmp_path)
    time.sleep(1.0)
    os.kill(proc.pid, sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == rc, stderr[-TAIL:]
    (line,) = [line for line in stderr.splitlines() if why in line]
    assert line.startswith(f"torchrec-tpu train: {why}; to continue from step "), line
    assert line.endswith(f", run the same command with --resume {root}"), line
    step = int(line.split("from step ")[1].split(",")[0])
    assert step > 0 and step % 2 == 0  # a step the checkpoints were saved at
