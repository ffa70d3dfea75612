"""A private, self-cleaning directory for a local Ray instance: nothing outlives the driver.

``ray.init()`` started by a driver leaves processes (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``) and a session directory under ``/tmp/ray`` behind when the driver is
killed (SIGKILL, OOM). :func:`ray_temp_dir` gives Ray a temporary directory of its own and starts a
watchdog process that waits for the driver: when the driver exits, however it exits, the watchdog
ends every process that names that directory on its command line or holds a file in it open
(every Ray process does) and removes the directory. Standard library only, so the watchdog starts fast.

Run as ``python -m pipelines.ray_session DIR DRIVER_PID`` it is the watchdog: it blocks on stdin (a pipe from
the driver) until end of file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

PREFIX = "trt-ray-"  # short: Ray's socket paths under it must stay within 107 bytes
_GRACE_S = 3.0


def processes_using(directory: str, spare: tuple[int, ...] = ()) -> list[int]:
    """Pids (other than this process and ``spare``) whose command line names ``directory`` or
    that hold a file under it open (Ray's agents rename their command line, but keep their logs
    there open)."""
    needle = directory.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), *spare):
            continue
        try:
            if needle in (entry / "cmdline").read_bytes() or any(
                    os.readlink(fd).startswith(directory) for fd in (entry / "fd").iterdir()):
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def clean_up(directory: str, driver: int) -> None:
    """End the processes using ``directory`` (SIGTERM, then SIGKILL after a grace period) and
    remove it. The ``driver`` process is spared: after ``ray.shutdown()`` it may still hold one
    of Ray's log files open, and it is leaving on its own."""
    pids = processes_using(directory, (driver,))
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = processes_using(directory, (driver,))
    _signal_all(pids, signal.SIGKILL)
    shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def ray_temp_dir() -> Iterator[str]:
    """A new temporary directory for ``ray.init(_temp_dir=...)``, watched as the module docstring
    says; on a normal exit the watchdog is waited for, so the directory is gone on return."""
    directory = tempfile.mkdtemp(prefix=PREFIX, dir=os.environ.get("RAY_TMPDIR"))  # where Ray would go
    package_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    watchdog = subprocess.Popen([sys.executable, "-m", "pipelines.ray_session", directory, str(os.getpid())],
                                stdin=subprocess.PIPE, env=env, start_new_session=True)
    try:
        yield directory
    finally:
        assert watchdog.stdin is not None
        watchdog.stdin.close()
        try:
            watchdog.wait(timeout=30)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            clean_up(directory, os.getpid())


def _watch(directory: str, driver: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the driver; it closes the pipe
    sys.stdin.buffer.read()  # end of file: the driver is done or dead
    clean_up(directory, driver)


if __name__ == "__main__":
    _watch(sys.argv[1], int(sys.argv[2]))
