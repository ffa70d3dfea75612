"""Which devices the distributed tests run on: cpu always, tpu once the torch_tpu core provides it."""

from __future__ import annotations

import functools

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
