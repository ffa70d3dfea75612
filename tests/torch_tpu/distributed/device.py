"""Which devices the distributed tests run on: cpu always, tpu once the torch_tpu core provides it."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch


@functools.cache
def tpu_ready() -> bool:
    """True when ``import torch_tpu`` registers a working "tpu" device in this process."""
    try:
        import torch_tpu  # noqa: F401 -- registers the device

        return torch.empty(1, device="tpu").device.type == "tpu"
    except (ImportError, RuntimeError):
        return False


def prepare_device(device: str) -> None:
    """Make ``device`` usable in a spawned rank (registers tpu; cpu needs nothing)."""
    import torch_tpu.distributed  # noqa: F401 -- registers the tpu_dist backend

    if device == "tpu" and not tpu_ready():
        raise RuntimeError("torch_tpu did not register a working 'tpu' device")


DEVICES = ["cpu", "tpu"]


def launch_on_tpu(job: Callable[..., Any], world: int, timeout_s: float, *args: Any) -> list[Any]:
    """``launch_local(job, world, *args)``'s results; skips where the tpu device is not registered yet."""
    from torch_tpu.distributed.local_launch import launch_local

    if not tpu_ready():
        pytest.skip("torch_tpu core has not registered the tpu device yet")
    return launch_local(job, world, *args, timeout_s=timeout_s)


def mismatch_outcome(call: Callable[[], object]) -> tuple[str, float]:
    """(``CollectiveMismatchError``'s message, or "no error"; seconds until it came) of ``call``."""
    from torch_tpu.compile.collectives.collectives import CollectiveMismatchError

    start = time.monotonic()
    try:
        call()
        message = "no error"
    except CollectiveMismatchError as e:
        message = str(e)
    return message, time.monotonic() - start
