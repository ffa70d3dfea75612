"""One job at a time per log or checkpoint directory: an exclusive ``flock`` on a lock file in it.

Two jobs writing one checkpoint root would prune each other's saves (a half-written one
included) and move each other's ``latest``. The lock file records the holder (pid, host) so the
refused job can name it. ``flock`` belongs to the open file, so the kernel releases it when the
holder dies in any way (SIGKILL included): a lock file left by a dead job never blocks the next.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Iterator

from torchrec_tpu.train.config import ConfigError

LOCK_FILE = ".torchrec-tpu.lock"


class DirectoryInUse(ConfigError):
    """Another live job holds the directory's lock; the message names it (pid, host)."""


@contextlib.contextmanager
def locked(directory: Path, flag: str) -> Iterator[None]:
    """Hold the lock of ``directory`` (created if missing; given by ``flag``) for the block;
    DirectoryInUse naming the holder when another job has it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DirectoryInUse(f"{flag}={str(directory)!r} is in use by another torchrec-tpu job "
                                 f"({_holder(path)}; lock file {path}): wait for it to finish or give "
                                 "another directory") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on host {holder['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown: its lock file is being written"
