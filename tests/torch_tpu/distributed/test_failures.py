"""A rank that dies or stalls makes the other ranks fail with a clear error, within the timeout."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.torch_tpu.distributed.device import tpu_ready
from tests.torch_tpu.distributed.failure_checks import (
    DEAD_EXIT_CODE,
    ddp_stalled_peer,
    dead_peer,
    stalled_peer,
    xla_dead_peer,
    xla_stalled_peer,
)
from torch_tpu.distributed.local_launch import launch_local

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 3.0
# Liveness bound, not a speed target: without a timeout these would hang until pytest's 600 s.
HANG_BOUND_S = 6 * TIMEOUT_S


def test_dead_peer_raises_clear_error() -> None:
    survivor, _ = launch_local(dead_peer, 2, timeout_s=TIMEOUT_S, expect_exit={1: DEAD_EXIT_CODE})
    first, second = survivor["first"], survivor["second"]
    assert first["error"] is not None, "allreduce with a dead peer returned normally"
    assert first["error"].startswith("CollectiveError: tpu_dist allreduce failed"), first["error"]
    assert "rank 0 of 2" in first["error"]
    assert first["seconds"] < HANG_BOUND_S
    # Later collectives fail immediately with the first failure instead of touching the transport.
    assert second["error"] is not None and "tpu_dist allreduce failed" in second["error"]
    assert second["seconds"] < 1.0


def test_stalled_peer_times_out() -> None:
    survivor, _ = launch_local(stalled_peer, 2, timeout_s=TIMEOUT_S)
    assert survivor["error"] is not None, "allreduce with a stalled peer returned normally"
    assert "tpu_dist allreduce failed" in survivor["error"]
    assert f"timeout {TIMEOUT_S:g}s" in survivor["error"]
    assert TIMEOUT_S * 0.5 <= survivor["seconds"] < HANG_BOUND_S


def test_ddp_backward_with_a_stalled_peer_raises() -> None:
    """DDP's reducer reads the all_reduce's future in C++: a failed collective must fail it there
    (a future holding the error as its value crashed the survivor with SIGSEGV)."""
    survivor, _ = launch_local(ddp_stalled_peer, 2, timeout_s=TIMEOUT_S)
    assert survivor["error"] is not None, "DDP backward with a stalled peer returned normally"
    assert "tpu_dist allreduce failed" in survivor["error"], survivor["error"]
    assert f"timeout {TIMEOUT_S:g}s" in survivor["error"], survivor["error"]
    assert survivor["seconds"] < HANG_BOUND_S


def _xla_survivor(fn: object, tmp_path: pathlib.Path, expect_exit: dict[int, int]) -> dict:
    if not tpu_ready():
        pytest.skip("torch_tpu core has not registered the tpu device yet")
    path = tmp_path / "survivor.json"
    launch_local(fn, 2, str(path), timeout_s=TIMEOUT_S, expect_exit=expect_exit)
    return json.loads(path.read_text())


def test_xla_transport_dead_peer_raises_clear_error(tmp_path: pathlib.Path) -> None:
    survivor = _xla_survivor(xla_dead_peer, tmp_path, {0: 0, 1: DEAD_EXIT_CODE})
    assert survivor["error"] is not None, "allreduce with a dead peer returned normally"
    assert survivor["error"].startswith("CollectiveError: tpu_dist allreduce failed"), survivor
    assert survivor["seconds"] < HANG_BOUND_S


def test_xla_transport_stalled_peer_times_out(tmp_path: pathlib.Path) -> None:
    survivor = _xla_survivor(xla_stalled_peer, tmp_path, {0: 0, 1: 0})
    assert survivor["error"] is not None, "allreduce with a stalled peer returned normally"
    assert "XLA collective did not finish within 3s" in survivor["error"], survivor
    assert TIMEOUT_S * 0.5 <= survivor["seconds"] < HANG_BOUND_S
