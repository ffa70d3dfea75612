"""FdoRecorder.all_reduce over a real gloo process group (2 ranks on loopback)."""

import socket

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsecore.limits import FdoRecorder
from sparsecore.preprocess import preprocess
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking

from .helpers import random_kjt


def _plan():
    table = TableSpec("t", 2048, 8, max_ids_per_partition=24, max_unique_ids_per_partition=24)
    return plan_stacking([table], [FeatureSpec("f", "t", 32)], SparseCoreTopology("v6e", 1))


def _recorder(rank: int) -> FdoRecorder:
    plan = _plan()
    recorder = FdoRecorder()
    for step in range(2):  # rank 1 sends more ids per sample, so its demand (and drops) differ
        recorder.record(preprocess(random_kjt(plan, seed=10 * rank + step, max_hot=4 + 6 * rank), plan,
                                   overflow="drop").stats)
    return recorder


def _worker(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        recorder = _recorder(rank)
        recorder.all_reduce()
        results[rank] = recorder.state()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawning two interpreters with torch + torchrec takes ~15-90 s here
@pytest.mark.multiprocess
def test_all_reduce_equals_the_plain_merge():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(port, results), nprocs=2, start_method="spawn", join=True)
    expected = FdoRecorder.merge_states([_recorder(0).state(), _recorder(1).state()])
    assert expected["t/dropped_ids"][0] > 0
    for rank in range(2):
        assert sorted(results[rank]) == sorted(expected)
        for key, value in expected.items():
            np.testing.assert_array_equal(results[rank][key], value)
