"""DDP, FSDP2 and DTensor training on tpu_dist (2 ranks) match one CPU process to 1e-5."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.device import DEVICES, tpu_ready
from tests.distributed.launch import run_ranks
from tests.distributed.training_checks import make_model, reference, run_all

pytestmark = pytest.mark.multiprocess

WORLD = 2
# The torch_tpu core sends _c10d_functional ops (DTensor's redistribute/full_tensor) to its CPU
# fallback, which returns outputs before wait_tensor fills them (reported to the core).
CORE_GAPS = {"dtensor", "redistribute"}


@pytest.fixture(scope="module", params=DEVICES)
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    device = request.param
    if device == "tpu" and not tpu_ready():
        pytest.skip("torch_tpu core has not registered the tpu device yet")
    out = tmp_path_factory.mktemp(f"training_{device}")
    return {"device": device, "ranks": run_ranks(run_all, WORLD, out, device)}


def _strategy(results: dict, name: str, request: pytest.FixtureRequest) -> list:
    if results["device"] == "tpu" and name in CORE_GAPS:
        request.applymarker(pytest.mark.xfail(strict=True, reason="core: _c10d_functional redispatch"))
    per_rank = [r[name] for r in results["ranks"]]
    for rank, got in enumerate(per_rank):
        assert not isinstance(got, str), f"rank {rank} {name} on {results['device']}: {got}"
    return per_rank


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "dtensor"])
def test_training_matches_single_process_cpu(results: dict, name: str, request: pytest.FixtureRequest) -> None:
    want = reference()
    initial = make_model().state_dict()
    for rank, state in enumerate(_strategy(results, name, request)):
        assert state.keys() == want.keys()
        for key, value in state.items():
            torch.testing.assert_close(value, want[key], rtol=0, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name} {key}: {m}")
            # Guard against a vacuous pass: training must have moved every parameter.
            assert not torch.allclose(value, initial[key]), f"{name} {key} did not train"


def test_dtensor_redistribute_round_trips(results: dict, request: pytest.FixtureRequest) -> None:
    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    for rank, got in enumerate(_strategy(results, "redistribute", request)):
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
