"""Every tpu_dist collective against plain gloo on CPU, bit for bit, on loopback ranks.

2 ranks: cpu tensors, and tpu tensors on the XLA transport and on the gloo transport. 4 ranks
(slow): tpu tensors on each transport.
"""

from __future__ import annotations

import pytest
import torch

from tests.torch_tpu.distributed.collective_checks import CHECKS, _data, uneven_in
from tests.torch_tpu.distributed.conftest import WORLD, results_for, run_job

pytestmark = pytest.mark.multiprocess


def _assert_same(ours: object, ref: object, where: str) -> None:
    if isinstance(ref, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: got {type(ours).__name__}"
        assert ours.dtype == ref.dtype, f"{where}: dtype {ours.dtype} != {ref.dtype}"
        # Same inputs, same reduction order as gloo: results must be bit-identical.
        torch.testing.assert_close(ours, ref, rtol=0, atol=0, msg=lambda m: f"{where}: {m}")
    elif isinstance(ref, list):
        assert isinstance(ours, list) and len(ours) == len(ref), f"{where}: {ours!r} vs {ref!r}"
        for i, (o, r) in enumerate(zip(ours, ref)):
            _assert_same(o, r, f"{where}[{i}]")
    else:
        assert ours == ref, f"{where}: {ours!r} != {ref!r}"


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_collective_matches_gloo(job: dict, name: str) -> None:
    for rank, (ours, ref) in enumerate(results_for(job, "collectives", name)):
        _assert_same(ours, ref, f"rank {rank} {name} on {job['device']}")


def test_uneven_all_to_all_moves_the_right_rows(job: dict) -> None:
    """Hand check, independent of gloo: rank 0 keeps 1 row and receives rank 1's first 3 rows."""
    sent = {r: _data(r, sum(uneven_in(r, WORLD)), 2, dtype=torch.int64) for r in range(WORLD)}
    expect = [torch.cat([sent[0][:1], sent[1][:3]]), sent[0][1:5]]
    for rank, (ours, _) in enumerate(results_for(job, "collectives", "all_to_all_single_uneven")):
        torch.testing.assert_close(ours, expect[rank], rtol=0, atol=0)


def test_transport_is_the_requested_one(job: dict) -> None:
    want = "gloo" if job["transport"] == "gloo" else "xla"  # auto: XLA wherever JAX has it
    assert [r["transport"] for r in job["ranks"]] == [want] * WORLD


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["xla", "gloo"])
def test_four_ranks_match_gloo(transport: str) -> None:
    """Both transports for tpu tensors on 4 ranks (pair subgroups: programs over part of the mesh)."""
    job = run_job("tpu", transport, world=4, training=False)
    assert [r["transport"] for r in job["ranks"]] == [transport] * 4
    for name in sorted(CHECKS):
        for rank, (ours, ref) in enumerate(results_for(job, "collectives", name)):
            _assert_same(ours, ref, f"rank {rank} {name} on 4 ranks, {transport} transport")
