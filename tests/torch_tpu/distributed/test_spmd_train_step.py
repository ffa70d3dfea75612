"""``torch_tpu.compile.train_step(..., group=...)`` on 2 loopback ranks (XLA transport): one SPMD
program per step with the gradient average and the model's all-to-all inside.

Reference: the same model stepped eagerly on CPU by each rank with DDP's rule by hand (the
gradients of every rank's batch averaged), and ``all_to_all_single_autograd`` run eagerly over
the gloo-backed default group. Also: the program holds the collectives (StableHLO), and ranks
whose step programs differ (other batch shapes) both fail clearly, well within the timeout.
"""

from __future__ import annotations

import copy
import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.torch_tpu.distributed.device import launch_on_tpu, mismatch_outcome
from tests.torch_tpu.distributed.exchanging import Exchanging, batch

pytestmark = [pytest.mark.multiprocess]

TIMEOUT_S = 60.0
WORLD = 2


def _job(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta) -> dict:
    import torch_tpu.distributed as tpu_dist

    os.environ[tpu_dist.backend.TRANSPORT_ENV] = "xla"
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout)
    import torch_tpu.compile as tc

    world = dist.group.WORLD
    results: dict = {}
    torch.manual_seed(0)
    model = Exchanging()
    reference = Exchanging()
    reference.load_state_dict(model.state_dict())
    model.to("tpu")
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    step = tc.train_step(model, optimizer, lambda m, x, y: m(x, y, world), group=world)
    losses, ref_losses = [], []
    for i in range(3):
        x, y = batch(rank, i)
        losses.append(float(step(x.to("tpu"), y.to("tpu"))))
        ref_loss = reference(x, y, world)  # eager all-to-all over the default group
        ref_loss.backward()
        for p in reference.parameters():  # DDP's rule: the ranks' gradients averaged
            dist.all_reduce(p.grad)
            p.grad /= size
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(ref_loss.item())
    results["losses"], results["ref_losses"] = losses, ref_losses
    results["params"] = {n: p.detach().cpu() for n, p in model.named_parameters()}
    results["ref_params"] = {n: p.detach() for n, p in reference.named_parameters()}
    results["programs"] = step.stats.compiles
    x, y = batch(rank, 0)
    results["hlo"] = step.hlo_text(x.to("tpu"), y.to("tpu"))

    # a second step over copies of the model and optimizer, from a fresh cache: the first traces
    # and stores its program, the second loads it (no trace); both train as the first step did
    state = ({n: p.detach().cpu() for n, p in model.named_parameters()}, copy.deepcopy(optimizer.state_dict()))
    tc.configure_cache(Path(os.environ["SPMD_TEST_CACHE"]) / f"rank{rank}")
    again = []
    for _ in range(2):
        twin = Exchanging()
        twin.load_state_dict(state[0])
        twin.to("tpu")
        twin_optimizer = torch.optim.Adagrad(twin.parameters(), lr=0.1)
        twin_optimizer.load_state_dict(copy.deepcopy(state[1]))
        tc.reset_cache_stats()
        twin_step = tc.train_step(twin, twin_optimizer, lambda m, x, y: m(x, y, world), group=world)
        x, y = batch(rank, 3)
        again.append((float(twin_step(x.to("tpu"), y.to("tpu"))), tc.cache_stats().step_misses,
                      tc.cache_stats().step_disk_hits))
    results["again"] = again

    # a new step whose first batch has another shape on rank 1: both ranks fail naming both
    # programs' inputs, instead of running programs whose collectives do not match
    step = tc.train_step(model, optimizer, lambda m, x, y: m(x, y, world), group=world)
    x, y = batch(rank, 9, rows=4 if rank == 0 else 8)
    results["mismatch"], results["mismatch_s"] = mismatch_outcome(lambda: step(x.to("tpu"), y.to("tpu")))
    dist.barrier()
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    os.environ["SPMD_TEST_CACHE"] = str(tmp_path_factory.mktemp("spmd_cache"))
    try:
        return launch_on_tpu(_job, WORLD, TIMEOUT_S)
    finally:
        del os.environ["SPMD_TEST_CACHE"]


def test_spmd_step_equals_eager_data_parallel_training(ranks: list[dict]) -> None:
    for r in ranks:
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["params"], r["ref_params"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


def test_one_program_holds_the_collectives(ranks: list[dict]) -> None:
    # Adagrad's state exists from the start: one program for all three steps
    assert [r["programs"] for r in ranks] == [1, 1]
    hlo = ranks[0]["hlo"]
    assert "all_to_all" in hlo and "all_reduce" in hlo


def test_a_stored_spmd_program_is_loaded_and_trains_the_same(ranks: list[dict]) -> None:
    for r in ranks:
        (first_loss, first_misses, first_hits), (second_loss, second_misses, second_hits) = r["again"]
        assert (first_misses, first_hits) == (1, 0) and (second_misses, second_hits) == (0, 1)
        assert second_loss == first_loss


def test_ranks_with_different_programs_fail_clearly(ranks: list[dict]) -> None:
    for r in ranks:
        assert "inputs differ between ranks" in r["mismatch"], r["mismatch"]
        assert "f32[8, 4]" in r["mismatch"] or "float32[8, 4]" in r["mismatch"]
        assert r["mismatch_s"] < TIMEOUT_S / 2
