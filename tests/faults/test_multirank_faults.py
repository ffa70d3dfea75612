"""Multi-rank failures under torchrun (real processes): bad input on one rank fails every rank at
once, the line said once, a stalled rank times out the others with a line naming the collective and
the rank (--collective-timeout), and ranks die with their launcher and stop on SIGTERM. Slow: each case starts two
training processes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.faults.conftest import TRAIN_FLAGS
from tests.faults.helpers import children, cli_env, communicate_or_dump, fail_with_stacks, torchrun_train
from tests.train.cli_ranks import TAIL, finish_cli_ranks, start_cli_ranks

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]



def _damage(data: Path, kind: str) -> str:
    """A NaN label in rank 0's rows, or a null id inside a multi-hot list in rank 1's rows (each
    rank reads half of the 768 training rows); returns what the error names."""
    part = data / ("part-00000.parquet" if kind == "nan_label" else "part-00002.parquet")
    table = pq.read_table(part)
    if kind == "nan_label":
        labels = table.column("label").to_numpy().astype(np.float32)
        labels[70] = np.nan
        pq.write_table(table.set_column(0, "label", pa.array(labels)), part)
        return f"rank 0: {part}: row 70, column label: nan is not a label in [0, 1]"
    for path in sorted(data.glob("*.parquet")):  # C3 multi-hot in every file, one null id in one
        t = pq.read_table(path)
        ids = [[int(v)] if v is not None else [] for v in t.column("C3").to_pylist()]
        if path == part:
            ids[70] = [1, None]
        pq.write_table(t.set_column(t.schema.get_field_index("C3"), "C3", pa.array(ids, pa.list_(pa.int64()))), path)
    return f"rank 1: {part}: row 70, column C3: a null id inside a multi-hot list"


def _rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=")[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


@pytest.mark.parametrize("engine, damage", [("sparsecore", "nan_label"), ("torchrec", "null_id")])
def test_bad_input_on_one_rank_fails_every_rank_at_once_with_one_message(tiny_copy, tmp_path, engine, damage):
    """The ranks agree on each batch before its collectives: both fail at the same batch, long
    before the collective timeout, the line said once, and neither aborts."""
    expected = _damage(tiny_copy, damage)
    flags = [f for f in TRAIN_FLAGS if f not in ("--max-steps", "2")]
    started = time.monotonic()
    result = subprocess.run(torchrun_train("--data", str(tiny_copy), *flags, "--log-dir", str(tmp_path / "run"),
                                      "--engine", engine, "--collective-timeout", "200"),
                            env=cli_env(), capture_output=True, text=True, timeout=300)
    assert time.monotonic() - started < 150, "failing must not wait for the collective timeout"
    assert result.returncode == 1, result.stderr[-3000:]
    assert "SIGABRT" not in result.stderr and "terminate called" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "torchrec-tpu train: error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]  # said once, by the first rank to fail
    assert f"error: {expected}" in errors[0], errors


# rank 0 too: the store lives in torchrun, not in it; with --dense-device tpu rank 0 also hosts
# JAX's coordination service, whose client must not abort the survivor before the timeout line
@pytest.mark.parametrize("stalled, dense_device", [(1, "cpu"), (0, "cpu"), (0, "tpu"), (1, "tpu")])
def test_stalled_rank_times_out_the_other(tiny_dataset, tmp_path, stalled, dense_device):
    proc = subprocess.Popen(torchrun_train("--data", str(tiny_dataset), *TRAIN_FLAGS[:-3], "--no-progress",
                                      "--epochs", "100000", "--log-dir", str(tmp_path / "run"),
                                      "--dense-device", dense_device,
                                      "--checkpoint-every", "3", "--collective-timeout", "10"),
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(children(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = sorted(children(proc.pid))
        assert len(ranks) == 2
        latest = tmp_path / "run" / "checkpoint" / "latest"
        while not latest.exists() and time.monotonic() < deadline + 120 and proc.poll() is None:
            time.sleep(0.2)  # the first checkpoint (step 3): both ranks are training
        if not latest.exists():
            fail_with_stacks(proc, "training never reached step 3")
        stopped = {_rank_of(pid): pid for pid in ranks}[stalled]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr = communicate_or_dump(proc, 180)
        assert time.monotonic() - stopped_at < 120, "the survivor must fail after about the timeout"
    finally:
        for pid in children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    assert proc.returncode != 0
    # JAX's coordination service (rank 0 hosts it) must not abort the survivor before its own line
    assert "SIGABRT" not in stderr and "Fatal Python error" not in stderr, stderr[-TAIL:]
    errors = [line for line in stderr.splitlines() if "torchrec-tpu train: error:" in line]
    assert len(errors) == 1, stderr[-TAIL:]  # the survivor's; the stopped rank says nothing
    assert f"timed out after 10 s on rank {1 - stalled}: rank {stalled} is not responding" in errors[0], errors
    assert errors[0].split("error: ")[1].startswith(
        ("train step", "the agreement", "the sparse input", "the check after a sparse input dist",
         "the checkpoint save", "the divergence check")), errors


def test_ranks_exit_when_their_launcher_is_killed(tiny_dataset, tmp_path):
    proc = subprocess.Popen(torchrun_train("--data", str(tiny_dataset), *TRAIN_FLAGS[:-3], "--no-progress",
                                      "--epochs", "100000", "--log-dir", str(tmp_path / "run")),
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(children(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = children(proc.pid)
    assert len(ranks) == 2
    time.sleep(20)  # well into startup or training (PR_SET_PDEATHSIG is set first thing)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = [pid for pid in ranks if _alive(pid)]
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    assert not orphans, f"ranks {orphans} outlived their launcher"


def test_a_rank_waiting_for_its_peers_stops_on_sigterm(tiny_dataset, tmp_path):
    """Only rank 0 of 2 starts, so it waits for rank 1 inside a C++ store wait, where Python runs
    no signal handler: SIGUSR1 prints where it waits, and SIGTERM (torchrun stopping a job that
    failed to start) still ends it within seconds, with one line."""
    argv = ["train", "--data", str(tiny_dataset), *TRAIN_FLAGS, "--log-dir", str(tmp_path / "run")]
    ranks = start_cli_ranks(argv, tmp_path / "ranks", only=[0])
    (proc, out), = ranks
    unjoined = ranks.store.num_keys()
    deadline = time.monotonic() + 180
    while ranks.store.num_keys() == unjoined and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # until rank 0 has posted to the store: it has joined and waits for rank 1
    assert proc.poll() is None and ranks.store.num_keys() > unjoined, out.read_text()[-TAIL:]
    proc.send_signal(signal.SIGUSR1)  # where is it? every thread's stack, and it runs on
    deadline = time.monotonic() + 30
    while "most recent call first" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "agree_on_config" in out.read_text() and proc.poll() is None, out.read_text()[-TAIL:]
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    (rc,) = finish_cli_ranks(ranks, timeout=30)
    assert time.monotonic() - sent < 10, "SIGTERM must end a rank at once"
    output = out.read_text()
    assert rc == 128 + signal.SIGTERM, output[-TAIL:]
    assert "torchrec-tpu train: stopped by SIGTERM (rank 0 of 2)" in output.splitlines(), output[-TAIL:]
    assert "Traceback" not in output, output[-TAIL:]


def test_skipped_rows_on_one_rank_keep_the_ranks_in_step(tiny_copy, tmp_path):
    """--bad-values skip on one rank's rows leaves it a batch short: every rank ends the epoch at
    the same step and the report counts the rows of all ranks."""
    part = tiny_copy / "part-00000.parquet"  # rank 0's rows
    table = pq.read_table(part)
    labels = table.column("label").to_numpy().astype(np.float32)
    labels[[3, 4, 90]] = [7.0, -3.0, np.nan]
    pq.write_table(table.set_column(0, "label", pa.array(labels)), part)
    flags = [f for f in TRAIN_FLAGS if f not in ("--max-steps", "2")]
    result = subprocess.run(torchrun_train("--data", str(tiny_copy), *flags, "--log-dir", str(tmp_path / "run"),
                                      "--bad-values", "skip", "--epochs", "2", "--collective-timeout", "60"),
                            env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bad values: skipped 3 rows" in result.stdout
    # 384 rows per rank, 32 per rank-batch: rank 0 keeps 381 -> 11 full batches, so 11 steps per epoch
    assert "steps           22 " in result.stdout, result.stdout
