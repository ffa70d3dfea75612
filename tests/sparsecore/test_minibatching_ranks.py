"""Minibatching at 2 ranks (gloo on loopback): the ranks agree on one split, so they run the same
k passes, each pass still fits, and every rank's minibatches equal the single-process build
with the OR of both ranks' splits."""

import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsecore.minibatching import agree_over_ranks, minibatch_entries
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs

from .helpers import random_kjt


def _plan():
    table = TableSpec("t", 4096, 8, max_ids_per_partition=24, max_unique_ids_per_partition=24)
    return plan_stacking([table], [FeatureSpec("f", "t", 64)], SparseCoreTopology("v5p", 1))


def _inputs(rank: int):
    """Rank 0's batch fits; rank 1's sends more ids per sample and overflows."""
    plan = _plan()
    return feature_inputs(random_kjt(plan, seed=7 + rank, max_hot=3 + 12 * rank, id_range=600), plan.features,
                          plan.tables)


def _worker(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        entries = minibatch_entries(_plan().stacks[0], _inputs(rank), 1, 4, agree_over_ranks())
        results[rank] = (entries.num_minibatches, entries.minibatch.tolist(), entries.row.tolist())
    finally:
        dist.destroy_process_group()


def _split(rank: int) -> int:
    """The split bits rank ``rank``'s batch needs alone (what it offers the other rank)."""
    seen = []
    minibatch_entries(_plan().stacks[0], _inputs(rank), 1, 4, agree=lambda split: seen.append(split) or split)
    return seen[0]


@pytest.mark.slow  # two interpreters with torch + torchrec
@pytest.mark.multiprocess
def test_two_ranks_agree_on_the_split():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").Manager().dict()
    mp.start_processes(_worker, args=(port, results), nprocs=2, start_method="spawn", join=True)
    both = _split(0) | _split(1)
    assert _split(0) == 0 and _split(1) != 0  # only rank 1 overflows alone
    for rank in range(2):
        plan = _plan()
        expected = minibatch_entries(plan.stacks[0], _inputs(rank), 1, 4, agree=lambda _: both)
        k, minibatch, row = results[rank]
        assert k == both.bit_count() + 1 == expected.num_minibatches > 1
        assert minibatch == expected.minibatch.tolist() and row == expected.row.tolist()
