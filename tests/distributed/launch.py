"""Spawn a real multi-process job on loopback for tests: one process per rank, results via files.

The parent owns a TCPStore on a free port (port 0), so there is no port race; children join it
as clients. A rank's exception fails the launch with that rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import pathlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = pathlib.Path(__file__).resolve().parents[2]


def _child(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    out_dir: str,
    timeout_s: float,
    args: tuple,
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    result = fn(rank, world_size, store, datetime.timedelta(seconds=timeout_s), *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    out_dir: pathlib.Path,
    *args: Any,
    timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, store, timeout, *args)`` in ``world_size`` spawned processes.

    Returns each rank's return value (rank order). ``fn`` must be importable (module level).
    """
    master = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                           wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    mp.start_processes(
        _child, args=(fn, world_size, master.port, str(out_dir), timeout_s, args),
        nprocs=world_size, join=True, start_method="spawn",
    )
    del master
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
