"""One spawned 2-rank job per device runs every collective and training check (spawns are slow)."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from tests.distributed import collective_checks, training_checks
from tests.distributed.device import DEVICES, prepare_device, tpu_ready
from torch_tpu.distributed.local_launch import launch_local

WORLD = 2


def _job(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta, device: str) -> dict:
    prepare_device(device)
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout)
    gloo = dist.new_group(backend="gloo")
    results = {
        "collectives": collective_checks.run_checks(rank, size, device, gloo),
        "training": training_checks.run_strategies(rank, size, device),
    }
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="session", params=DEVICES)
def job(request: pytest.FixtureRequest) -> dict:
    """{"device", "ranks": [per-rank {"collectives": {...}, "training": {...}}]}."""
    device = request.param
    if device == "tpu" and not tpu_ready():
        pytest.skip("torch_tpu core has not registered the tpu device yet")
    return {"device": device, "ranks": launch_local(_job, WORLD, device)}


def results_for(job: dict, section: str, name: str) -> list:
    """Per-rank results of one check; fails with the rank's error text if a rank raised."""
    per_rank = [r[section][name] for r in job["ranks"]]
    for rank, got in enumerate(per_rank):
        assert not isinstance(got, str), f"rank {rank} {name} on {job['device']}: {got}"
    return per_rank
