"""No minute without a line (issue 77): the README's main job, ``torchrec-tpu train`` with its
defaults (``./dev.sh train``), run as a user runs it, in a fresh compile cache (so the
``--dense-device auto`` timing and every compile happen, as on a first run), its output
(stdout and stderr, a pipe: Python block-buffers ``print``) timestamped line by line as it
arrives: no two consecutive lines, nor the start and the first line, more than 60 s apart."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_GAP_S = 60.0


def timestamped_lines(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, list]:
    """``command``'s exit code and its output lines, each with the seconds since the start at which
    it arrived (killed after ``timeout`` seconds)."""
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    try:
        lines = [(time.monotonic() - started, line.rstrip("\n")) for line in proc.stdout]
    finally:
        watchdog.cancel()
        rc = proc.wait()
    return rc, [*lines, (time.monotonic() - started, "<exit>")]


def longest_silence(lines: list[tuple[float, str]]) -> tuple[float, str]:
    """The longest wait for a line (from the start too) and the line that ended it."""
    before, longest = 0.0, (0.0, "")
    for at, text in lines:
        if at - before > longest[0]:
            longest = (at - before, text)
        before = at
    return longest


def test_longest_silence_counts_the_start():
    assert longest_silence([(70.0, "first"), (80.0, "<exit>")]) == (70.0, "first")
    assert longest_silence([(1.0, "a"), (2.0, "b"), (65.0, "<exit>")]) == (63.0, "<exit>")


@pytest.mark.slow  # the whole default job (about 4 minutes on 2 busy cores)
def test_the_default_train_job_says_something_every_minute(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TORCH_TPU_COMPILE_CACHE": str(tmp_path / "cache")}
    rc, lines = timestamped_lines([sys.executable, "-m", "torchrec_tpu.cli", "train"], tmp_path, env, timeout=1200)
    log = "\n".join(f"{at:7.1f}s {text[:160]}" for at, text in lines)
    assert rc == 0, log[-5000:]
    gap, after = longest_silence(lines)
    assert gap <= MAX_GAP_S, f"{gap:.0f} s without a line before {after!r}:\n{log[:2500]}\n...\n{log[-2500:]}"
