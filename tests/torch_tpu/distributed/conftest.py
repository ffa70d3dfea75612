"""One spawned 2-rank job per (device, transport) runs every collective and training check.

Spawns are slow, so each job runs all checks once. The XLA transport is the default ("auto"): the
cpu job gets it too (its cpu tensors take the gloo path inside it); the tpu jobs pin "xla" and
"gloo", so every check compares both transports with plain gloo on CPU.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist

from tests.torch_tpu.distributed import collective_checks, training_checks
from tests.torch_tpu.distributed.device import prepare_device, tpu_ready
from torch_tpu.distributed.local_launch import launch_local

WORLD = 2
JOBS = [("cpu", "auto"), ("tpu", "xla"), ("tpu", "gloo")]


def _job(
    rank: int,
    size: int,
    store: dist.Store,
    timeout: datetime.timedelta,
    device: str,
    transport: str,
    training: bool,
) -> dict:
    import torch_tpu.distributed as tpu_dist

    os.environ[tpu_dist.backend.TRANSPORT_ENV] = transport
    # Before the device is first used: the default group joins jax.distributed for XLA.
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout)
    prepare_device(device)
    gloo = dist.new_group(backend="gloo")
    results = {
        "transport": tpu_dist.active_transport(),
        "collectives": collective_checks.run_checks(rank, size, device, gloo),
        "training": training_checks.run_strategies(rank, size, device) if training else {},
    }
    dist.destroy_process_group()
    return results


def run_job(device: str, transport: str, world: int = WORLD, training: bool = True) -> dict:
    """{"device", "transport", "ranks": [per-rank {"transport", "collectives", "training"}]}."""
    if device == "tpu" and not tpu_ready():
        pytest.skip("torch_tpu core has not registered the tpu device yet")
    ranks = launch_local(_job, world, device, transport, training, timeout_s=120)
    return {"device": device, "transport": transport, "ranks": ranks}


@pytest.fixture(scope="session", params=JOBS, ids=[f"{d}-{t}" for d, t in JOBS])
def job(request: pytest.FixtureRequest) -> dict:
    return run_job(*request.param)


def results_for(job: dict, section: str, name: str) -> list:
    """Per-rank results of one check; fails with the rank's error text if a rank raised."""
    per_rank = [r[section][name] for r in job["ranks"]]
    for rank, got in enumerate(per_rank):
        where = f"{job['device']}/{job['transport']}"
        assert not isinstance(got, str), f"rank {rank} {name} on {where}: {got}"
    return per_rank
