"""DDP, FSDP2 and DTensor training on tpu_dist (2 ranks) match one CPU process to 1e-5."""

from __future__ import annotations

import pytest
import torch

from tests.torch_tpu.distributed.conftest import WORLD, results_for
from tests.torch_tpu.distributed.training_checks import make_model, reference

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "dtensor"])
def test_training_matches_single_process_cpu(job: dict, name: str) -> None:
    want = reference()
    initial = make_model().state_dict()
    for rank, state in enumerate(results_for(job, "training", name)):
        assert state.keys() == want.keys()
        for key, value in state.items():
            torch.testing.assert_close(value, want[key], rtol=0, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name} {key}: {m}")
            # Guard against a vacuous pass: training must have moved every parameter.
            assert not torch.allclose(value, initial[key]), f"{name} {key} did not train"


def test_dtensor_redistribute_round_trips(job: dict) -> None:
    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    for rank, got in enumerate(results_for(job, "training", "redistribute")):
        expect = {
            "local_rows": full[3 * rank:3 * rank + 3],
            "rows_to_cols": full[:, 2 * rank:2 * rank + 2],
            "rows_to_replicate": full,
            "full": full,
            "partial_sum": full * sum(r + 1 for r in range(WORLD)),  # Partial(sum) of (rank+1)*full
        }
        for key, value in expect.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0,
                                       msg=lambda m: f"rank {rank} {key}: {m}")


def test_topology_aware_device_mesh_runs_collectives(job: dict) -> None:
    for got in results_for(job, "training", "topology_mesh"):
        assert got["mesh"] == list(range(WORLD)) and got["names"] == ("dp",)
        torch.testing.assert_close(got["sum"], torch.full((3,), float(sum(range(1, WORLD + 1)))))


def test_torchrec_sharding_matches_gloo(job: dict) -> None:
    if job["device"] != "cpu":
        pytest.skip("torchrec 1.8 has no tpu compute device; covered on cpu tensors")
    for got in results_for(job, "training", "torchrec"):
        first, second = got["ours"]
        torch.testing.assert_close(got["ours"], got["gloo"], rtol=0, atol=0)
        assert first.shape == (4, 24) and not torch.equal(first, second), "no fused update seen"
