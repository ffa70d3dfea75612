"""``launch_local``: run N ranks as local processes on loopback (tests, benchmarks, notebooks).

For real jobs use torchrun (see the package docstring). Here the parent owns a TCPStore on a free
port (port 0, so no port race) and each spawned child joins it as a client and gets it as an
argument, ready for ``init_process_group("tpu_dist", store=store, ...)``. Return values come back
through files; a rank that raises fails the launch with that rank's traceback; a rank may also be
expected to die (``expect_exit``), for failure tests.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pathlib
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

LAUNCH_DEADLINE_S = 300.0


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
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world_size, store, datetime.timedelta(seconds=timeout_s), *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        pathlib.Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def launch_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    expect_exit: dict[int, int] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, store, timeout, *args)`` in ``world_size`` spawned processes.

    Returns each rank's return value in rank order (None for ranks in ``expect_exit``, which
    must exit with the given code). ``fn`` must be importable (module level); ``timeout`` is a
    ``timedelta`` of ``timeout_s`` for the process group.
    """
    with tempfile.TemporaryDirectory(prefix="tpu_dist_launch_") as tmp:
        return _launch(fn, world_size, args, timeout_s, expect_exit or {}, pathlib.Path(tmp))


def _launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    timeout_s: float,
    expect_exit: dict[int, int],
    out_dir: pathlib.Path,
) -> list[Any]:
    master = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                           wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_child, args=(r, fn, world_size, master.port, str(out_dir), timeout_s, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(LAUNCH_DEADLINE_S)
    for p in procs:
        if p.is_alive():
            p.kill()
    failures = []
    for rank, p in enumerate(procs):
        if p.exitcode != expect_exit.get(rank, 0):
            err = out_dir / f"rank{rank}.err"
            detail = err.read_text() if err.exists() else "(no traceback: killed or hung)"
            failures.append(f"rank {rank} exited with {p.exitcode}:\n{detail}")
    if failures:
        raise RuntimeError("launch_local: " + "\n".join(failures))
    return [
        None if rank in expect_exit else torch.load(out_dir / f"rank{rank}.pt", weights_only=False)
        for rank in range(world_size)
    ]
