"""A tpu_dist default group destroyed and made again on a store that outlives it (torchrun's agent
store; TorchRec's ``SingleProcessContext`` does this once per test): each round connects afresh.
c10d reuses the group's name after the destroy, so the last round's gloo addresses were still in
the store; a peer reading them connected to a closed port ("Connection refused", the second of
TorchRec's uneven all-to-all tests failing or hanging about every other run). Rank 0 comes to each
new round late, so rank 1 reads the store before rank 0 has written anything of that round."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from torch_tpu.distributed.local_launch import launch_local

pytestmark = pytest.mark.multiprocess

ROUNDS = 3


def _rounds(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta) -> list[list[float]]:
    sums = []
    for round_ in range(ROUNDS):
        if rank == 0 and round_:
            time.sleep(2.0)  # rank 1 is in the store first
        dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout)
        device, host = torch.full((2,), rank + 1.0, device="tpu"), torch.full((2,), 10.0 * (rank + 1))
        dist.all_reduce(device)
        dist.all_reduce(host)
        sums.append([*device.cpu().tolist(), *host.tolist()])
        dist.destroy_process_group()
    return sums


def test_a_group_made_again_on_the_same_store_connects_afresh() -> None:
    assert launch_local(_rounds, 2, timeout_s=60) == [[[3.0, 3.0, 30.0, 30.0]] * ROUNDS] * 2
