"""Joining multi-controller JAX: import order, argument errors, transport choice errors."""

from __future__ import annotations

import datetime
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import torch_tpu.distributed as tpu_dist
from tests.torch_tpu.distributed.device import tpu_ready
from torch_tpu.distributed import launch_local, xla_join

REPO = pathlib.Path(__file__).resolve().parents[3]


def _join_then_use_device(
    rank: int, size: int, store: dist.Store, timeout: datetime.timedelta
) -> dict:
    """The documented order for a process that needs the device before init_process_group."""
    import torch_tpu.distributed as tpu_dist

    tpu_dist.init_xla_transport(store, rank=rank, world_size=size)
    x = torch.full((3,), float(rank + 1), device="tpu")
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout)
    dist.all_reduce(x)
    result = {"transport": tpu_dist.active_transport(), "sum": x.cpu()}
    dist.destroy_process_group()
    return result


@pytest.mark.multiprocess
def test_explicit_join_lets_the_device_come_before_the_group() -> None:
    if not tpu_ready():
        pytest.skip("torch_tpu core has not registered the tpu device yet")
    for got in launch_local(_join_then_use_device, 2):
        assert got["transport"] == "xla"
        torch.testing.assert_close(got["sum"], torch.full((3,), 3.0), rtol=0, atol=0)


def test_importing_the_stack_does_not_start_the_jax_backend() -> None:
    """jax.distributed.initialize must be able to run after these imports, before device use."""
    code = (
        "import torch_tpu, torch_tpu.distributed, torchrec_tpu\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge.backends_are_initialized(), 'backend started at import'\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_bad_rank_is_named() -> None:
    with pytest.raises(ValueError, match=r"rank 3 is not in \[0, world_size=2\)"):
        tpu_dist.init_xla_transport(rank=3, world_size=2, coordinator_address="127.0.0.1:1")


def test_joining_after_the_backend_started_is_refused() -> None:
    import torch

    torch.ones(1, device="tpu").cpu()  # starts the JAX backend in this (single) process
    if xla_join.joined():
        pytest.skip("this process already runs multi-controller JAX")
    with pytest.raises(RuntimeError, match="before the first device use"):
        tpu_dist.init_xla_transport(rank=0, world_size=2, coordinator_address="127.0.0.1:1")
    reason = xla_join.xla_unavailable_reason(0, [0, 1])
    assert reason is not None and "init_xla_transport" in reason


def test_transport_options_reject_unknown_names() -> None:
    with pytest.raises(ValueError, match="'nccl' is not one of auto, xla, gloo"):
        tpu_dist.TransportOptions("nccl")


def test_missing_torchrun_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK is not set"):
        tpu_dist.init_xla_transport()


def test_a_joined_process_still_dies_by_sigterm() -> None:
    """torchrun stops a job (and PR_SET_PDEATHSIG ends an orphan) with SIGTERM: joining JAX must
    not take it over (its preemption service catches it in C++ and the process runs on)."""
    code = (
        "import os, signal, socket, time\n"
        "import torch_tpu.distributed as tpu_dist\n"
        "with socket.socket() as s:\n"
        "    s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]\n"
        "tpu_dist.init_xla_transport(rank=0, world_size=1, coordinator_address=f'127.0.0.1:{port}')\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-3000:])
