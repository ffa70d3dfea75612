"""Two ranks with the dense towers on tpu, replicated (DDP) or sharded (FSDP2 ``fully_shard``)
over the one tpu_dist group that also carries the EBC's all_to_alls (tpu tensors by the XLA
transport), train like one rank on the whole batch: same losses, weights, tables and held-out
metrics."""

from __future__ import annotations

import pytest
import torch

from tests.train.dense_device_checks import STEPS, rank_body, train
from torch_tpu.distributed.local_launch import launch_local

MODEL = "dlrm_dcn"  # the cross net has parameters of its own: three towers to sync or shard


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return train("tpu", model=MODEL)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("parallel, prefetch", [("ddp", False), ("ddp", True), ("fsdp2", False)])
def test_two_ranks_on_tpu_equal_one_rank(parallel: str, prefetch: bool, one_rank: dict) -> None:
    ranks = launch_local(rank_body, 2, "tpu", parallel, MODEL, prefetch, timeout_s=300.0)
    for got in ranks:
        # ddp: one SPMD program per step on each rank, holding the lookup, the embedding
        # all-to-alls and the fused update too (the input dist run ahead, or first in the step)
        assert got["compiled_steps"] == (STEPS if parallel == "ddp" else 0)
        assert got["fused_steps"] == (STEPS if parallel == "ddp" else 0)
        assert got["compiled_eval"] == (parallel == "ddp")  # the towers one program per rank
        assert got["devices"] == {"tpu"} and got["transport"] == "xla"
        # each rank's loss is the mean over its half of the batch: their mean is the global loss
        torch.testing.assert_close([sum(pair) / 2 for pair in zip(*(r["losses"] for r in ranks))],
                                   one_rank["losses"], rtol=0, atol=1e-5)
        assert set(got["state"]) == set(one_rank["state"])
        for name, value in one_rank["state"].items():
            torch.testing.assert_close(got["state"][name], value, rtol=0, atol=1e-5, msg=f"{parallel} {name}")
        assert got["auc"] == pytest.approx(one_rank["auc"], abs=1e-5)
        assert got["eval_loss"] == pytest.approx(one_rank["eval_loss"], abs=1e-5)
