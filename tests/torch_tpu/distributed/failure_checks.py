"""Rank bodies for the failure tests: a peer dies or stalls; the survivor must raise, not hang."""

from __future__ import annotations

import datetime
import json
import os
import time

import torch
import torch.distributed as dist

from tests.torch_tpu.distributed.device import prepare_device
from torch_tpu.distributed import TransportOptions

DEAD_EXIT_CODE = 17
# The gloo transport's failure semantics. On the XLA transport a dead peer fails the collective
# too, but JAX's coordination service then terminates every survivor (multi-controller JAX is
# fail-fast: the launcher restarts the whole job), so survivors cannot report back here.
GLOO = TransportOptions("gloo")


def _attempt(collective: str) -> dict:
    t = torch.ones(4)
    start = time.monotonic()
    try:
        if collective == "allreduce":
            dist.all_reduce(t)
        else:
            dist.all_to_all_single(torch.empty(4), t, [1, 3], [3, 1])
    except Exception as exc:  # the error under test
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _join(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta) -> None:
    """This rank in the default tpu_dist group (gloo transport), past a first barrier."""
    prepare_device("cpu")
    dist.init_process_group(
        "tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout, pg_options=GLOO
    )
    dist.barrier()


def dead_peer(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta) -> dict:
    """Rank 1 dies after a first collective; rank 0 then runs two more."""
    _join(rank, size, store, timeout)
    if rank == 1:
        os._exit(DEAD_EXIT_CODE)
    first = _attempt("allreduce")
    second = _attempt("all_to_all")  # the group is poisoned: must fail at once, same cause
    return {"first": first, "second": second}


def stalled_peer(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta) -> dict:
    """Rank 1 stays alive but never joins the collective; rank 0 must time out."""
    _join(rank, size, store, timeout)
    if rank == 1:
        store.wait(["rank0_done"], datetime.timedelta(seconds=120))
        return {}
    result = _attempt("allreduce")
    store.set("rank0_done", "1")
    return result


def ddp_stalled_peer(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta) -> dict:
    """DDP over the group: rank 1 never runs the backward, so rank 0's gradient all_reduce times
    out inside DDP's reducer, which reads the failed collective's future from C++."""
    _join(rank, size, store, timeout)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    if rank == 1:
        store.wait(["rank0_done"], datetime.timedelta(seconds=60))
        return {}
    start = time.monotonic()
    try:
        model(torch.ones(2, 4)).sum().backward()
        result = {"error": None}
    except Exception as exc:  # the error under test
        result = {"error": f"{type(exc).__name__}: {exc}"}
    store.set("rank0_done", "1")
    return {**result, "seconds": time.monotonic() - start}


def _xla_world(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta) -> None:
    import torch_tpu.distributed as tpu_dist

    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout,
                            pg_options=tpu_dist.TransportOptions("xla"))
    prepare_device("tpu")
    dist.all_reduce(torch.ones(4, device="tpu"))  # connections up, program compiled


def _leave(result: dict, path: str) -> None:
    """Report through a file, then leave without teardown: after a failed collective JAX's
    coordination service aborts a process that exits normally (a peer is gone or a program stuck)."""
    with open(path, "w") as f:
        json.dump(result, f)
    os._exit(0)


def _attempt_on_device() -> dict:
    t = torch.ones(4, device="tpu")
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        t.cpu()
    except Exception as exc:  # the error under test
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def xla_dead_peer(
    rank: int, size: int, store: dist.Store, timeout: datetime.timedelta, path: str
) -> None:
    """XLA transport: rank 1 dies after a first collective; rank 0 runs one more."""
    _xla_world(rank, size, store, timeout)
    if rank == 1:
        os._exit(DEAD_EXIT_CODE)
    _leave(_attempt_on_device(), path)


def xla_stalled_peer(
    rank: int, size: int, store: dist.Store, timeout: datetime.timedelta, path: str
) -> None:
    """XLA transport: rank 1 stays alive but never joins; rank 0 must time out."""
    _xla_world(rank, size, store, timeout)
    if rank == 1:
        store.wait(["rank0_done"], datetime.timedelta(seconds=120))
        os._exit(0)
    result = _attempt_on_device()
    store.set("rank0_done", "1")
    _leave(result, path)
