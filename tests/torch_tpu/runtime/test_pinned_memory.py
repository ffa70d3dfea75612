"""Pinned host memory for the tpu device (torch_tpu.runtime.host_hooks): ``pin_memory()`` /
``is_pinned()`` and copies through pinned tensors; stock DDP with ``static_graph=True`` on tpu at
2 ranks (which stages its used-parameter map in pinned memory) gives CPU DDP's gradients."""

from __future__ import annotations

import ctypes
import datetime

import pytest
import torch
import torch.distributed as dist

import torch_tpu  # noqa: F401
from tests.torch_tpu.distributed.device import prepare_device
from torch_tpu.distributed import launch_local
from torch_tpu.runtime import host_hooks


def test_pinned_host_tensors_round_trip() -> None:
    assert isinstance(host_hooks._registered[0], ctypes.CDLL), "the C++ hooks were not registered (no C++ compiler?)"
    pinned = torch.arange(6.0).pin_memory()
    assert pinned.is_pinned() and not torch.arange(6.0).is_pinned()
    assert torch.empty(4, pin_memory=True).is_pinned()
    on_device = torch.zeros(6, device="tpu")
    on_device.copy_(pinned, non_blocking=True)
    torch.testing.assert_close(on_device.cpu(), torch.arange(6.0), rtol=0, atol=0)
    back = torch.empty(6, pin_memory=True)
    back.copy_(on_device * 2)
    torch.testing.assert_close(back, torch.arange(6.0) * 2, rtol=0, atol=0)


def _ddp_grads(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta, device: str) -> list:
    prepare_device(device)
    dist.init_process_group("tpu_dist" if device == "tpu" else "gloo", store=store, rank=rank, world_size=size,
                            timeout=timeout)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, static_graph=True)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model.zero_grad()
        ddp(x.to(device)).sum().backward()
    grads = [p.grad.cpu() for p in model.parameters()]
    dist.destroy_process_group()
    return grads


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_static_graph_on_tpu_equals_cpu() -> None:
    want = launch_local(_ddp_grads, 2, "cpu", timeout_s=120.0)
    got = launch_local(_ddp_grads, 2, "tpu", timeout_s=120.0)
    for rank in range(2):
        for g, w in zip(got[rank], want[rank]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
