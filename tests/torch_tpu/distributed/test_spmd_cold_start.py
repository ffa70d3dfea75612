"""A 2-rank job's second run compiles nothing: each rank's SPMD step executable is stored in the
persistent cache (``torch_tpu.compile.program.executables``) and loaded by the next run's processes.

JAX's own cache does not serve these programs: its key differs per process on XLA:CPU and only
process 0 writes, so before they were stored here rank 1 compiled its step program on every run.
Reference: XLA's compile count in each rank (``xla_cache.compiles``), and the first run's losses,
which the loaded executables must reproduce exactly."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.torch_tpu.distributed.device import launch_on_tpu
from tests.torch_tpu.distributed.exchanging import Exchanging, batch

pytestmark = [pytest.mark.multiprocess]

TIMEOUT_S = 120.0
WORLD = 2
STEPS = 3


def _job(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta, cache: str) -> dict:
    import torch_tpu.distributed as tpu_dist

    os.environ[tpu_dist.backend.TRANSPORT_ENV] = "xla"
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout)
    import torch_tpu.compile as tc
    import xla_cache

    tc.configure_cache(cache)  # one directory for both ranks, as a job's default cache
    world = dist.group.WORLD
    torch.manual_seed(0)
    model = Exchanging().to("tpu")
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    batches = [tuple(t.to("tpu") for t in batch(rank, i)) for i in range(STEPS)]
    before = xla_cache.compiles()
    step = tc.train_step(model, optimizer, lambda m, x, y: m(x, y, world), group=world)
    losses = [float(step(*batch)) for batch in batches]
    compiled = xla_cache.compiles() - before
    dist.barrier()
    dist.destroy_process_group()
    return {"compiles": compiled, "losses": losses}


@pytest.mark.slow  # two 2-rank launches (~20 s); test_spmd_train_step's stored-program test and
# test_cache_default's second-process test keep the store-then-load path in the default run
def test_the_second_run_of_a_two_rank_step_compiles_nothing(tmp_path: Path) -> None:
    cold = launch_on_tpu(_job, WORLD, TIMEOUT_S, str(tmp_path))
    warm = launch_on_tpu(_job, WORLD, TIMEOUT_S, str(tmp_path))
    assert [r["compiles"] for r in cold] == [1, 1]  # the step program, once per rank
    assert [r["compiles"] for r in warm] == [0, 0]
    for first, second in zip(cold, warm):
        assert second["losses"] == first["losses"]
