"""Several ranks on one host are bound to disjoint blocks of its CPUs (each in a fresh process:
binding changes the process it runs in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, sys
from torchrec_tpu.train.distributed import bind_to_local_cpus
block = bind_to_local_cpus(int(sys.argv[1]), int(sys.argv[2]))
print(json.dumps([None if block is None else sorted(block), sorted(os.sched_getaffinity(0))]))
"""


def probe(local_rank: int, local_world_size: int) -> tuple[list[int] | None, list[int]]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(local_rank), str(local_world_size)], check=True,
                         capture_output=True, text=True).stdout
    block, affinity = json.loads(out.strip().splitlines()[-1])
    return block, affinity


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
