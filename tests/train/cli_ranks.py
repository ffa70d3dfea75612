"""Run the ``torchrec-tpu`` CLI as several ranks on loopback under torchrun's environment variables.

As torchrun does, the launcher (this process) hosts the rendezvous store on a port the kernel
picked and keeps open (``TORCHELASTIC_USE_AGENT_STORE``: every rank is its client), so jobs
started at once never meet on one port. A rank still running at the deadline is asked for its
Python stacks (SIGUSR1, :func:`torchrec_tpu.launcher.prepare_process`) before it is killed, and the
failure shows each rank's output with them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import pytest
import torch.distributed as dist

from tests.train.conftest import REPO_ROOT, TINY_OPTIONS, as_flags

if TYPE_CHECKING:
    from torchrec_tpu.train.config import TrainConfig
    from torchrec_tpu.train.data import TrainData
    from torchrec_tpu.train.distributed import DistEnv
    from torchrec_tpu.train.model import ModelSpec

WORLD = 2
STACKS_WAIT_S = 3.0  # for a rank to write its stacks after SIGUSR1
TAIL = 8000

CLI = "import sys; from torchrec_tpu import cli; sys.exit(cli.main(sys.argv[1:]))"


class CliRanks(list):
    """The ranks of one job as ``(process, output file)`` pairs, and the store they meet in."""

    def __init__(self, ranks: list[tuple[subprocess.Popen, Path]], store: dist.TCPStore) -> None:
        super().__init__(ranks)
        self.store = store


def launcher_store(world: int) -> dist.TCPStore:
    """A rendezvous store hosted here on a port the kernel picked (held open until it is dropped)."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=300))


def rank_env(rank: int, world: int, store: dist.TCPStore) -> dict[str, str]:
    """torchrun's environment for ``rank`` of ``world``, joining ``store`` as a client."""
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": f"cli-ranks-{store.port}"}


def start_cli_ranks(argv: list[str], run_dir: Path, world: int = WORLD, name: str = "rank",
                    per_rank: list[list[str]] | None = None, only: list[int] | None = None) -> CliRanks:
    """Start ``torchrec-tpu <argv> <per_rank[rank]>`` as ``world`` fresh processes (only the
    ranks in ``only``, when given); each rank's output goes to ``run_dir/<name><rank>.out``. Not
    forked: the test process may have JAX running (sparsecore tests), and a forked JAX runtime
    deadlocks."""
    run_dir.mkdir(parents=True, exist_ok=True)
    store = launcher_store(world)
    ranks = []
    for rank in range(world) if only is None else only:
        out = run_dir / f"{name}{rank}.out"
        extra = per_rank[rank] if per_rank else []
        with open(out, "w") as stream:
            ranks.append((subprocess.Popen([sys.executable, "-c", CLI, *argv, *extra], env=rank_env(rank, world, store),
                                           stdout=stream, stderr=subprocess.STDOUT, cwd=REPO_ROOT), out))
    return CliRanks(ranks, store)


def dump_stacks_and_kill(pids: list[int]) -> None:
    """Ask each live process for its Python stacks (SIGUSR1), give them time to write, kill them."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(STACKS_WAIT_S)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish_cli_ranks(ranks: list[tuple[subprocess.Popen, Path]], timeout: float = 300) -> list[int | None]:
    """Each rank's exit status; ranks still running after ``timeout`` seconds fail the test with
    every rank's output, stacks of the hung ones included."""
    deadline = time.monotonic() + timeout
    for proc, _ in ranks:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    hung = [rank for rank, (proc, _) in enumerate(ranks) if proc.poll() is None]
    if hung:
        dump_stacks_and_kill([ranks[rank][0].pid for rank in hung])
        for proc, _ in ranks:
            proc.wait()
        outs = "\n".join(f"--- rank {rank} ({'hung' if rank in hung else f'exit {proc.returncode}'}):\n"
                         f"{out.read_text()[-TAIL:]}" for rank, (proc, out) in enumerate(ranks))
        pytest.fail(f"ranks {hung} still running after {timeout:g} s (stacks below, from SIGUSR1):\n{outs}")
    return [proc.returncode for proc, _ in ranks]


def wait_cli_ranks(ranks: list[tuple[subprocess.Popen, Path]], timeout: float = 300) -> list[str]:
    """Wait for the ranks of :func:`start_cli_ranks` to succeed; returns each rank's output."""
    codes = finish_cli_ranks(ranks, timeout)
    for rank, (code, (_, out)) in enumerate(zip(codes, ranks)):
        assert code == 0, f"rank {rank} exited with {code}:\n{out.read_text()[-TAIL:]}"
    return [out.read_text() for _, out in ranks]


def launch_cli_ranks(argv: list[str], run_dir: Path) -> list[str]:
    """Run ``torchrec-tpu <argv>`` on WORLD ranks to completion; returns each rank's output."""
    return wait_cli_ranks(start_cli_ranks(argv, run_dir))


def train_on_ranks(data: Path, run_dir: Path, **options: object) -> tuple[Path, list[str]]:
    """``torchrec-tpu train`` of the tiny options updated by ``options`` over ``data`` on WORLD
    ranks, logging to ``run_dir/logs``: (that log dir, each rank's output)."""
    log_dir = run_dir / "logs"
    argv = ["train", "--data", str(data), "--log-dir", str(log_dir), *as_flags({**TINY_OPTIONS, **options})]
    return log_dir, launch_cli_ranks(argv, run_dir)


def latest_meta(log_dir: Path) -> dict[str, Any]:
    """The meta.json of the latest checkpoint a run logging to ``log_dir`` saved."""
    return json.loads((log_dir / "checkpoint" / "latest" / "meta.json").read_text())


@contextlib.contextmanager
def on_one_rank(log_dir: Path) -> Iterator[tuple[TrainConfig, DistEnv, TrainData, ModelSpec]]:
    """The config of the run logging to ``log_dir``, a process group of this one rank, the run's
    data and model spec: what reloading its checkpoint on one rank builds the model from."""
    from torchrec_tpu.train.config import TrainConfig
    from torchrec_tpu.train.data import open_data
    from torchrec_tpu.train.distributed import process_group
    from torchrec_tpu.train.job import model_spec

    config = TrainConfig.from_options(**latest_meta(log_dir)["config"])
    with process_group() as env, open_data(config, env) as data:
        assert env.world_size == 1
        yield config, env, data, model_spec(config, data.schema.sparse, data.table_sizes, len(data.schema.dense))
