"""Issue 74: a 2-rank job whose batches overflow the SparseCore partition limits trains under
--id-overflow minibatch exactly as the same job with limits large enough (SGD bit-equal, others
within 1e-6), each rank's step one compiled program (the ops backend's minibatches inside it,
the ranks agreeing on their slots); the same limits under --id-overflow error stop the job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.train.cli_ranks import finish_cli_ranks, start_cli_ranks, wait_cli_ranks
from tests.train.conftest import SPARSECORE_TABLES, TINY_OPTIONS, as_flags, flat_checkpoint
from torchrec_tpu.train.checkpoint.dirs import resolve_checkpoint

SMALL, LARGE = 8, 4096  # ids a table may send one partition (a stack's limit is its tables' sum)
OPTIONS = {**TINY_OPTIONS, "engine": "sparsecore", "sparse_backend": "ops", "dense_device": "tpu",
           "max_steps": 4, "epochs": 1}


def _argv(data: Path, log_dir: Path, optimizer: str, limit: int, policy: str) -> list[str]:
    return ["train", "--data", str(data), "--log-dir", str(log_dir),
            *as_flags({**OPTIONS, "sparse_optimizer": optimizer, "max_ids_per_partition": limit,
                       "id_overflow": policy})]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1800)  # three 2-rank jobs one after another
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_two_ranks_minibatched_equal_large_limits(tiny_dataset: Path, tmp_path: Path, optimizer: str) -> None:
    states = {}
    for name, limit, policy in (("minibatch", SMALL, "minibatch"), ("large", LARGE, "error")):
        run = tmp_path / name
        out0, _ = wait_cli_ranks(start_cli_ranks(_argv(tiny_dataset, run / "logs", optimizer, limit, policy), run),
                                 timeout=900)
        assert "training step: one compiled program per rank (SPMD over 2 ranks)" in out0
        states[name] = flat_checkpoint(resolve_checkpoint(run / "logs" / "checkpoint"), tmp_path / f"{name}.pt")
    got, expected = states["minibatch"], states["large"]
    tensors = [key for key, value in expected.items() if isinstance(value, torch.Tensor)]
    assert any(key.startswith(SPARSECORE_TABLES) for key in tensors), tensors
    for key in tensors:
        if optimizer == "sgd":
            assert torch.equal(got[key], expected[key]), key
        else:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-6, msg=key)
    run = tmp_path / "error"
    ranks = start_cli_ranks(_argv(tiny_dataset, run / "logs", optimizer, SMALL, "error"), run)
    assert finish_cli_ranks(ranks, timeout=900) != [0, 0]
    assert any("ids > max_ids_per_partition" in out.read_text() for _, out in ranks)
