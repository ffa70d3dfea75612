"""Shared helpers of the fault tests: the CLI as a real process, tiny inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.sample_data import criteo_sample_csv
from tests.train.cli_ranks import TAIL, dump_stacks_and_kill

REPO_ROOT = Path(__file__).resolve().parents[2]


def cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "torchrec_tpu.cli", *args]


def run_cli(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """``torchrec-tpu ARGS`` in a fresh process; stdout/stderr captured as text."""
    return subprocess.run(cli_command(*args), env=cli_env(), capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


def assert_clean_error(rc: int, stderr: str, *fragments: str) -> str:
    """rc 1/2, one ``error:`` line holding every fragment, no traceback; returns the line."""
    assert rc in (1, 2), f"rc {rc}, stderr:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def sample_tsv_lines(repeat: int = 1) -> list[str]:
    """The real Criteo sample's 200 rows as headerless TSV lines, ``repeat`` times over."""
    rows = criteo_sample_csv().read_text().splitlines()[1:]
    return [row.replace(",", "\t") for row in rows] * repeat


def write_sample_tsv(path: Path, repeat: int = 1) -> Path:
    path.write_text("\n".join(sample_tsv_lines(repeat)) + "\n")
    return path


def torchrun_train(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "-m", "torchrec_tpu.cli", "train", *args]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def communicate_or_dump(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc.communicate()`` of a launcher (torchrun) run with text pipes; past ``timeout``
    seconds its ranks are asked for their Python stacks (SIGUSR1), killed with it, and the test
    fails showing its stderr, where the stacks went."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        dump_stacks_and_kill(children(proc.pid))
        proc.kill()
        _, stderr = proc.communicate()
        pytest.fail(f"still running after {timeout:g} s; stderr, the ranks' stacks included:\n{stderr[-TAIL:]}")
