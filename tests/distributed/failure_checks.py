"""Rank bodies for the failure tests: a peer dies or stalls; the survivor must raise, not hang."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from tests.distributed.device import prepare_device
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


def dead_peer(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta) -> dict:
    """Rank 1 dies after a first collective; rank 0 then runs two more."""
    prepare_device("cpu")
    dist.init_process_group(
        "tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout, pg_options=GLOO
    )
    dist.barrier()
    if rank == 1:
        os._exit(DEAD_EXIT_CODE)
    first = _attempt("allreduce")
    second = _attempt("all_to_all")  # the group is poisoned: must fail at once, same cause
    return {"first": first, "second": second}


def stalled_peer(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta) -> dict:
    """Rank 1 stays alive but never joins the collective; rank 0 must time out."""
    prepare_device("cpu")
    dist.init_process_group(
        "tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout, pg_options=GLOO
    )
    dist.barrier()
    if rank == 1:
        store.wait(["rank0_done"], datetime.timedelta(seconds=120))
        return {}
    result = _attempt("allreduce")
    store.set("rank0_done", "1")
    return result
