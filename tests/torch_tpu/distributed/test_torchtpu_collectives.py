"""torch.tpu.ops' collectives at 2 ranks (real processes on loopback): ``ragged_all_to_all`` over
gloo on CPU tensors against a hand-computed exchange, and over tpu_dist on tpu tensors equal to
gloo's result (with the operand's gradient); ``all_gather_dim`` / ``reduce_scatter_dim`` against
``torch.cat`` / a sum; ``send`` / ``recv``."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from tests.torch_tpu.distributed.device import prepare_device
from torch_tpu.distributed import launch_local
from tpu_facts import knobs

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
WORLD = 2


def _operand(rank: int, device: str) -> torch.Tensor:
    return (torch.arange(12.0).reshape(6, 2) + 100 * rank).to(device)


# rank r sends rows [r, r + 1 + r) to rank 0 and [3, 5) to rank 1; receivers place them at the
# offsets the sender names
_IN_OFF = {0: [0, 3], 1: [1, 3]}
_SEND = {0: [1, 2], 1: [2, 2]}
_OUT_OFF = {0: [0, 0], 1: [2, 3]}  # rank 0's rows go to rank 0 row 0, rank 1 row 0; rank 1's to rows 2 and 3
_RECV = {0: [1, 2], 1: [2, 2]}


def _expected(rank: int) -> torch.Tensor:
    out = torch.full((6, 2), -1.0)
    for sender in range(WORLD):
        rows = _operand(sender, "cpu")[_IN_OFF[sender][rank]:][:_SEND[sender][rank]]
        at = _OUT_OFF[sender][rank]
        out[at:at + rows.shape[0]] = rows
    return out


def _job(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta, device: str) -> dict:
    os.environ.setdefault(knobs.DIST_TRANSPORT.name, "gloo")  # tpu tensors over gloo's transport
    prepare_device(device)
    import torch_tpu  # noqa: F401

    backend = "gloo" if device == "cpu" else "tpu_dist"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    ops = torch.tpu.ops
    name = dist.group.WORLD.group_name
    operand = _operand(rank, device).requires_grad_(True)
    ints = {k: torch.tensor(v[rank], device=device) for k, v in
            (("in", _IN_OFF), ("send", _SEND), ("out", _OUT_OFF), ("recv", _RECV))}
    got = ops.ragged_all_to_all(operand, torch.full((6, 2), -1.0, device=device), ints["in"], ints["send"],
                                ints["out"], ints["recv"], name)
    (got * (rank + 1)).sum().backward()
    x = torch.arange(6.0, device=device).reshape(2, 3) + 10 * rank
    gathered = ops.all_gather_dim(x, 1)
    scattered = ops.reduce_scatter_dim(torch.arange(8.0, device=device).reshape(2, 4) * (rank + 1), 1)
    buf = torch.zeros(3, device=device)
    if rank == 0:
        ops.send([torch.arange(3.0, device=device)], 1, 7).wait()
    else:
        ops.recv([buf], 0, 7).wait()
    dist.destroy_process_group()
    return {"a2a": got.detach().cpu(), "grad": operand.grad.cpu(), "gathered": gathered.cpu(),
            "scattered": scattered.cpu(), "received": buf.cpu()}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    return {device: launch_local(_job, WORLD, device, timeout_s=120.0) for device in ("cpu", "tpu")}


def test_ragged_all_to_all_moves_the_named_rows(results) -> None:
    for rank, r in enumerate(results["cpu"]):
        torch.testing.assert_close(r["a2a"], _expected(rank), rtol=0, atol=0)


def test_tpu_equals_gloo(results) -> None:
    for cpu, tpu in zip(results["cpu"], results["tpu"]):
        for key in cpu:
            torch.testing.assert_close(tpu[key], cpu[key], rtol=0, atol=0, msg=key)


def test_the_gradient_goes_back_to_the_sent_rows(results) -> None:
    for rank, r in enumerate(results["cpu"]):
        want = torch.zeros(6, 2)
        for dest in range(WORLD):  # each row sent to dest carries dest's loss weight dest + 1
            want[_IN_OFF[rank][dest]:][:_SEND[rank][dest]] += dest + 1
        torch.testing.assert_close(r["grad"], want, rtol=0, atol=0)


def test_gather_scatter_and_point_to_point(results) -> None:
    x = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(WORLD)]
    y = sum(torch.arange(8.0).reshape(2, 4) * (r + 1) for r in range(WORLD))
    for rank, r in enumerate(results["cpu"]):
        torch.testing.assert_close(r["gathered"], torch.cat(x, 1), rtol=0, atol=0)
        torch.testing.assert_close(r["scattered"], y[:, 2 * rank:2 * rank + 2], rtol=0, atol=0)
    torch.testing.assert_close(results["cpu"][1]["received"], torch.arange(3.0), rtol=0, atol=0)
