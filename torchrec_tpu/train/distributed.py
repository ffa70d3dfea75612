"""The gloo process group training runs over: from torchrun's environment, or a private world of 1.

Every group gets the collective timeout (``--collective-timeout``, default 300 s): a collective
that a stalled rank never joins fails on the others after that long instead of hanging (gloo's and
tpu_dist's timeouts; :func:`new_group` passes it on, as ``dist.new_group`` does not inherit it).
A rank under torchrun also dies with its launcher (``PR_SET_PDEATHSIG``), leaving no orphans.
With several ranks a :mod:`~torchrec_tpu.train.rank_watch` heartbeat runs, so a failed collective
names the rank that stalled or failed (a failing rank posts its error before leaving).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Iterator

import torch.distributed as dist

from torchrec_tpu.errors import one_line
from torchrec_tpu.launcher import die_with_parent
from torchrec_tpu.train import rank_watch

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the training world."""

    rank: int
    world_size: int
    local_world_size: int
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.collective_timeout_s)

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


def current_env(collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> DistEnv:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_world_size=local,
                   collective_timeout_s=collective_timeout_s)


def new_group(env: DistEnv, backend: str | None = None) -> dist.ProcessGroup:
    """``dist.new_group`` over all ranks with ``env``'s collective timeout (a collective)."""
    return dist.new_group(backend=backend, timeout=env.timeout)


@contextlib.contextmanager
def process_group(collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> Iterator[DistEnv]:
    """Join the default process group for the duration of a run.

    Reuses one that already exists (the caller owns it), joins torchrun's world when its
    environment variables are set, and otherwise makes a world of 1 over an in-memory store, so a
    plain run needs no port.
    """
    if dist.is_initialized():
        yield current_env(collective_timeout_s)
        return
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    if all(v in os.environ for v in _TORCHRUN_VARS):
        die_with_parent()
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    env = current_env(collective_timeout_s)
    try:
        if env.world_size == 1:
            yield env
            return
        with rank_watch.watching(dist.distributed_c10d._get_default_store(), env.rank, env.world_size,
                                 collective_timeout_s) as watch:
            try:
                yield env
            except BaseException as error:
                watch.post_failure(one_line(error))
                raise
    finally:
        dist.destroy_process_group()
