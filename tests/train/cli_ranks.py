"""Run the ``torchrec-tpu`` CLI as several ranks on loopback under torchrun's environment variables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.train.conftest import REPO_ROOT

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CLI = "import sys; from torchrec_tpu import cli; sys.exit(cli.main(sys.argv[1:]))"


def start_cli_ranks(argv: list[str], run_dir: Path, world: int = WORLD,
                    name: str = "rank") -> list[tuple[subprocess.Popen, Path]]:
    """Start ``torchrec-tpu <argv>`` as ``world`` fresh processes under torchrun's environment
    variables; each rank's output goes to ``run_dir/<name><rank>.out``. Not forked: the test
    process may have JAX running (sparsecore tests), and a forked JAX runtime deadlocks."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    ranks = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        out = run_dir / f"{name}{rank}.out"
        with open(out, "w") as stream:
            ranks.append((subprocess.Popen([sys.executable, "-c", CLI, *argv], env=env, stdout=stream,
                                           stderr=subprocess.STDOUT, cwd=REPO_ROOT), out))
    return ranks


def wait_cli_ranks(ranks: list[tuple[subprocess.Popen, Path]], timeout: float = 300) -> list[str]:
    """Wait for the ranks of :func:`start_cli_ranks` to succeed; returns each rank's output."""
    try:
        codes = [proc.wait(timeout=timeout) for proc, _ in ranks]
    finally:
        for proc, _ in ranks:
            if proc.poll() is None:
                proc.kill()
    for rank, (code, (_, out)) in enumerate(zip(codes, ranks)):
        assert code == 0, f"rank {rank} exited with {code}:\n{out.read_text()[-3000:]}"
    return [out.read_text() for _, out in ranks]


def launch_cli_ranks(argv: list[str], run_dir: Path) -> list[str]:
    """Run ``torchrec-tpu <argv>`` on WORLD ranks to completion; returns each rank's output."""
    return wait_cli_ranks(start_cli_ranks(argv, run_dir))
