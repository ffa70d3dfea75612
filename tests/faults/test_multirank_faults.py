"""Multi-rank failures under torchrun (real processes): a rank failing on bad input never aborts
its peers, a stalled rank times out the others (--collective-timeout), and ranks die with their
launcher. Slow: each case starts two training processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.faults.conftest import TRAIN_FLAGS
from tests.faults.helpers import cli_env

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "-m", "torchrec_tpu.cli", "train", *args]


def _nan_label_in_rank0_rows(data: Path) -> None:
    for part in sorted(data.glob("*.parquet")):
        table = pq.read_table(part)
        labels = table.column("label").to_numpy().astype(np.float32)
        if part.name == "part-00000.parquet":
            labels[70] = np.nan  # rank 0 reads the first half of the training rows
        pq.write_table(table.set_column(0, "label", pa.array(labels)), part)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_a_rank_failing_on_bad_input_never_aborts_its_peer(tiny_copy, tmp_path):
    _nan_label_in_rank0_rows(tiny_copy)
    flags = [f for f in TRAIN_FLAGS if f not in ("--max-steps", "2")]
    result = subprocess.run(_torchrun("--data", str(tiny_copy), *flags, "--log-dir", str(tmp_path / "run"),
                                      "--collective-timeout", "60"),
                            env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "SIGABRT" not in result.stderr and "terminate called" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "torchrec-tpu train: error:" in line]
    assert len(errors) == 2, result.stderr[-3000:]
    assert any("training loss is NaN" in line for line in errors)


def test_stalled_rank_times_out_the_other(tiny_dataset, tmp_path):
    proc = subprocess.Popen(_torchrun("--data", str(tiny_dataset), *TRAIN_FLAGS[:-3], "--no-progress",
                                      "--epochs", "50", "--log-dir", str(tmp_path / "run"),
                                      "--collective-timeout", "10"),
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = sorted(_children(proc.pid))
        assert len(ranks) == 2
        time.sleep(25)  # both ranks are past startup and training
        os.kill(ranks[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr = proc.communicate(timeout=180)
        assert time.monotonic() - stopped_at < 120, "the survivor must fail after about the timeout"
    finally:
        for pid in _children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    assert proc.returncode != 0
    assert "error:" in stderr, stderr[-3000:]


def test_ranks_exit_when_their_launcher_is_killed(tiny_dataset, tmp_path):
    proc = subprocess.Popen(_torchrun("--data", str(tiny_dataset), *TRAIN_FLAGS[:-3], "--no-progress",
                                      "--epochs", "50", "--log-dir", str(tmp_path / "run")),
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = _children(proc.pid)
    assert len(ranks) == 2
    time.sleep(20)  # the ranks have joined the process group (PR_SET_PDEATHSIG is set by then)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = [pid for pid in ranks if _alive(pid)]
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    assert not orphans, f"ranks {orphans} outlived their launcher"
