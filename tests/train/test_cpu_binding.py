"""Several ranks on one host are bound to disjoint blocks of its CPUs (each in a fresh process:
binding changes the process it runs in), and never run more torch threads than their block has CPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, sys
from torchrec_tpu.train.distributed import bind_to_local_cpus, threads_for_this_rank
block = bind_to_local_cpus(int(sys.argv[1]), int(sys.argv[2]))
threads = [threads_for_this_rank(n) for n in (0, 1, 2, 1000)]
print(json.dumps([None if block is None else sorted(block), sorted(os.sched_getaffinity(0)), threads]))
"""


def probe(local_rank: int, local_world_size: int) -> tuple[list[int] | None, list[int]]:
    block, affinity, _ = probe_with_threads(local_rank, local_world_size)
    return block, affinity


def probe_with_threads(local_rank: int, local_world_size: int) -> tuple[list[int] | None, list[int], list[int]]:
    """(the block bound, the affinity after, threads_for_this_rank of 0, 1, 2 and 1000)."""
    out = subprocess.run([sys.executable, "-c", PROBE, str(local_rank), str(local_world_size)], check=True,
                         capture_output=True, text=True).stdout
    block, affinity, threads = json.loads(out.strip().splitlines()[-1])
    return block, affinity, threads


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and 2 CPUs")
def test_local_ranks_get_disjoint_blocks_of_the_cpus() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    blocks = [probe(rank, 2) for rank in range(2)]
    for block, affinity in blocks:
        assert block == affinity and len(block) == len(cpus) // 2  # the process runs on its block only
    assert not set(blocks[0][0]) & set(blocks[1][0])
    assert set(blocks[0][0]) | set(blocks[1][0]) <= set(cpus)


def test_one_rank_or_too_few_cpus_stay_unbound() -> None:
    everything = sorted(os.sched_getaffinity(0))
    assert probe(0, 1) == (None, everything)
    assert probe(0, len(everything) + 1) == (None, everything)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and 2 CPUs")
def test_a_bound_rank_runs_at_most_one_thread_per_cpu_of_its_block() -> None:
    block, _, threads = probe_with_threads(0, 2)
    per_rank = len(block)
    assert threads == [per_rank, 1, min(2, per_rank), per_rank]  # 0 means all of the block's CPUs
    _, everything, threads = probe_with_threads(0, 1)
    assert threads == [len(everything), 1, min(2, len(everything)), len(everything)]
