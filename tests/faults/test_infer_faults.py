"""`infer` as a real process: an error inside a Ray actor is one `error:` line (no Ray
tracebacks), and a driver killed with SIGKILL or interrupted (SIGINT) leaves no Ray process and no
Ray directory behind.
Slow: each case starts a Ray instance (~30-50 s here)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.ray_session import processes_using
from tests.faults.checkpoint_helpers import shared_run
from tests.faults.helpers import assert_clean_error, cli_command, cli_env, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_actor_error_is_one_line(tmp_path_factory, tmp_path):
    data, root = shared_run(tmp_path_factory)
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    part = copy / "part-00001.parquet"
    table = pq.read_table(part)
    values = table.column("I4").to_numpy().astype(np.float64)
    values[33] = np.inf
    pq.write_table(table.set_column(table.schema.get_field_index("I4"), "I4", pa.array(values)), part)
    (copy / "_COMPLETE.json").unlink()
    result = run_cli("infer", "--data", str(copy), "--checkpoint", str(root), "--output", str(tmp_path / "out"),
                     "--no-progress")
    assert_clean_error(result.returncode, result.stderr, f"{part}: row 33, column I4: inf is beyond float32's range")
    assert len(result.stderr.splitlines()) <= 4, result.stderr  # the error, its log file, at most 2 lines of Ray


def _watched_dir(driver: int, deadline: float) -> str | None:
    """The Ray directory of ``driver``: the watchdog's command line names it and the driver pid."""
    while time.monotonic() < deadline:
        out = subprocess.run(["pgrep", "-af", "pipelines.ray_session"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if parts[-1] == str(driver):
                return parts[-2]
        time.sleep(0.2)
    return None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_killed_driver_leaves_no_ray_processes_or_directory(tmp_path_factory, tmp_path, sig):
    """SIGKILL: the watchdog cleans up. SIGINT (Ctrl-C, which Ray's waits would swallow): the
    driver leaves at once with rc 130 and a line saying a rerun resumes."""
    data, root = shared_run(tmp_path_factory)
    proc = subprocess.Popen(cli_command("infer", "--data", str(data), "--checkpoint", str(root), "--output",
                                        str(tmp_path / "out"), "--no-progress"),
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        directory = _watched_dir(proc.pid, time.monotonic() + 120)
        assert directory is not None, "no Ray watchdog started"
        deadline = time.monotonic() + 120
        while len(processes_using(directory, (proc.pid,))) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)  # gcs_server, raylet, agents, workers
        ray_processes = processes_using(directory, (proc.pid,))
        assert len(ray_processes) >= 3 and proc.poll() is None
    finally:
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
    if sig == signal.SIGINT:
        assert proc.returncode == 130, stderr[-2000:]
        assert stderr.rstrip().endswith("torchrec-tpu infer: interrupted (rerun the same command to resume)")
    deadline = time.monotonic() + 30
    while (processes_using(directory) or Path(directory).exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = processes_using(directory)
    for pid in left:  # do not leave them to the next test
        subprocess.run(["kill", "-9", str(pid)])
    assert not left, f"Ray processes {left} outlived the killed driver"
    assert not Path(directory).exists(), f"{directory} was not removed"


def test_rerun_redoes_parts_of_a_rewritten_input(tmp_path_factory, tmp_path):
    """The input rewritten with the same row groups (its rows reversed): the rerun says so and
    predicts that file's parts again instead of keeping the old predictions."""
    data, root = shared_run(tmp_path_factory)
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    (copy / "_COMPLETE.json").unlink()
    out = tmp_path / "out"
    args = ("infer", "--data", str(copy), "--checkpoint", str(root), "--output", str(out), "--no-progress")
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p.name: pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))}
    part = copy / "part-00001.parquet"
    table = pq.read_table(part)
    pq.write_table(table.take(list(reversed(range(table.num_rows)))), part,
                   row_group_size=pq.ParquetFile(part).metadata.row_group(0).num_rows)
    second = run_cli(*args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"warning: {part} changed since its predictions" in second.stderr
    assert "redoing its 2 part(s)" in second.stderr
    assert "2 written, 4 already done" in second.stdout
    after = {p.name: pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))}
    redone = ("part-000002.parquet", "part-000003.parquet")  # the second file's two row groups
    assert {n for n in before if not after[n].equals(before[n])} <= set(redone)
    old = np.concatenate([before[n].column("prediction").to_numpy() for n in redone])
    new = np.concatenate([after[n].column("prediction").to_numpy() for n in redone])
    np.testing.assert_allclose(new, old[::-1], rtol=1e-5)


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 KiB tmpfs (two pages: the job's manifest and one part fit, the next part not);
    mounting needs root, the test is skipped without it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_full_disk_names_the_output(tmp_path_factory, small_disk):
    data, root = shared_run(tmp_path_factory)
    out = small_disk / "out"
    result = run_cli("infer", "--data", str(data), "--checkpoint", str(root), "--output", str(out), "--no-progress")
    line = assert_clean_error(result.returncode, result.stderr, f"cannot write {out}/part-", "No space left on device",
                              f"bytes free in {out}")
    assert not list(out.glob(".tmp-*")), line  # no partial part left behind
