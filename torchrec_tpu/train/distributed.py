"""The gloo process group training runs over: from torchrun's environment, or a private world of 1."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

import torch.distributed as dist

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the training world."""

    rank: int
    world_size: int
    local_world_size: int

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


def current_env() -> DistEnv:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_world_size=local)


@contextlib.contextmanager
def process_group() -> Iterator[DistEnv]:
    """Join the default process group for the duration of a run.

    Reuses one that already exists (the caller owns it), joins torchrun's world when its
    environment variables are set, and otherwise makes a world of 1 over an in-memory store, so a
    plain run needs no port.
    """
    if dist.is_initialized():
        yield current_env()
        return
    if all(v in os.environ for v in _TORCHRUN_VARS):
        dist.init_process_group("gloo", init_method="env://")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield current_env()
    finally:
        dist.destroy_process_group()
