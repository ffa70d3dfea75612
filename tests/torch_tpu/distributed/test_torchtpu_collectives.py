"""torch.tpu.ops' collectives at 2 ranks (real processes on loopback): ``ragged_all_to_all`` over
gloo on CPU tensors against a hand-computed exchange, and over tpu_dist on tpu tensors equal to
gloo's result (with the operand's gradient); ``all_gather_dim`` / ``reduce_scatter_dim`` against
``torch.cat`` / a sum; ``send`` / ``recv``. Plans the ranks disagree on, and a receive buffer unlike
the message, fail with one line on every rank involved, and the group goes on working."""

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


# each case: per rank (send_sizes, recv_sizes, operand columns, output rows); rank r sends its
# rows [0, send[j]) to rank j, placed at row 0 of j's output
_REFUSED = {
    "counts": ({0: [1, 2], 1: [2, 3]}, {0: [1, 2], 1: [3, 2]}, {0: 2, 1: 2}, {0: 6, 1: 6}),
    "widths": ({0: [1, 1], 1: [1, 1]}, {0: [1, 1], 1: [1, 1]}, {0: 2, 1: 3}, {0: 6, 1: 6}),
    "output": ({0: [1, 4], 1: [1, 1]}, {0: [1, 1], 1: [4, 1]}, {0: 2, 1: 2}, {0: 6, 1: 3}),
}


def _refused_job(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta, device: str) -> dict:
    os.environ.setdefault(knobs.DIST_TRANSPORT.name, "gloo")
    prepare_device(device)
    import torch_tpu  # noqa: F401

    backend = "gloo" if device == "cpu" else "tpu_dist"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    ops, name, errors = torch.tpu.ops, dist.group.WORLD.group_name, {}
    for case, (send, recv, cols, rows) in _REFUSED.items():
        operand = torch.ones(6, cols[rank], device=device)
        zeros = torch.zeros(2, dtype=torch.int64, device=device)
        try:
            ops.ragged_all_to_all(operand, torch.zeros(rows[rank], cols[rank], device=device), zeros,
                                  torch.tensor(send[rank], device=device), zeros,
                                  torch.tensor(recv[rank], device=device), name)
            errors[case] = "no error"
        except ValueError as e:
            errors[case] = str(e)
    # the group still works: the exchange of the first test
    ints = {k: torch.tensor(v[rank], device=device) for k, v in
            (("in", _IN_OFF), ("send", _SEND), ("out", _OUT_OFF), ("recv", _RECV))}
    after = ops.ragged_all_to_all(_operand(rank, device), torch.full((6, 2), -1.0, device=device), ints["in"],
                                  ints["send"], ints["out"], ints["recv"], name)
    dist.destroy_process_group()
    return {"errors": errors, "after": after.cpu()}


@pytest.fixture(scope="module")
def refused() -> dict[str, list[dict]]:
    return {device: launch_local(_refused_job, WORLD, device, timeout_s=60.0) for device in ("cpu", "tpu")}


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_plans_the_ranks_disagree_on_fail_every_rank_with_one_line(refused, device) -> None:
    """gloo aborted the receiving rank on mismatched counts (gloo::EnforceNotMet) and the sending
    rank's rows overran a shorter output; now every rank raises before a row moves."""
    r0, r1 = (r["errors"] for r in refused[device])
    assert r1["counts"] == ("tpu::_ragged_all_to_all: recv_sizes[0] is 3 on rank 1, but rank 0 sends it 2 rows "
                            "(its send_sizes[1])")
    assert r0["counts"] == ("tpu::_ragged_all_to_all: send_sizes[1] is 2 on rank 0, but rank 1 receives 3 rows "
                            "from it (its recv_sizes[0])")
    assert r0["widths"] == ("tpu::_ragged_all_to_all: rank 1's rows are torch.float32 with 3 elements, this "
                            "rank's torch.float32 with 2; every rank's operand and output must match")
    assert r1["output"] == "tpu::_ragged_all_to_all: rows [0, 4) from rank 0 are outside output's 3 rows"
    assert r0["output"] == ("tpu::_ragged_all_to_all: rank(s) [1] refused the exchange (see their error); "
                            "no rows were sent")
    for rank, r in enumerate(refused[device]):
        torch.testing.assert_close(r["after"], _expected(rank), rtol=0, atol=0)


def _receive_job(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta, transport: str) -> dict:
    """tpu_dist's own transports (on CPU tensors gloo, the backend, is not ours): tagged tpu tensors
    go through the gloo transport, untagged ones through ``transport``, cpu tensors gloo's without
    a host copy."""
    import torch_tpu.distributed as tpu_dist

    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout,
                            pg_options=tpu_dist.TransportOptions(transport))  # before the device: XLA joins
    prepare_device("tpu")
    errors, buffers = {}, {}
    for tag, on in ((7, "tpu"), (0, "tpu"), (0, "cpu")):
        case = f"recv tag {tag} {on}"
        if rank == 0:
            torch.tpu.ops.send([torch.arange(3.0, device=on)], 1, tag).wait()
            continue
        buffers[case] = torch.full((5,), -1.0, device=on)
        try:
            torch.tpu.ops.recv([buffers[case]], 0, tag).wait()
            errors[case] = "no error"
        except ValueError as e:
            errors[case] = str(e)
    # the group still works
    buf = torch.zeros(3, device="tpu")
    if rank == 0:
        torch.tpu.ops.send([torch.arange(3.0, device="tpu")], 1, 0).wait()
    else:
        torch.tpu.ops.recv([buf], 0, 0).wait()
    dist.destroy_process_group()
    return {"errors": errors, "buffers": {k: v.cpu() for k, v in buffers.items()}, "after": buf.cpu()}


@pytest.mark.parametrize("transport", ["gloo", "xla"])
def test_a_receive_buffer_larger_than_the_message_is_refused(transport) -> None:
    """It was filled with the 3 elements sent and 2 of uninitialised host memory, rc 0."""
    _, received = launch_local(_receive_job, WORLD, transport, timeout_s=60.0)
    errors, buffers = received["errors"], received["buffers"]
    assert len(buffers) == 3
    for case, buffer in buffers.items():
        tag = case.split()[2]
        assert errors[case] == (
            f"tpu_dist recv: rank 0 sent 3 elements of torch.float32 (tag {tag}), the receive buffer holds 5 of "
            "torch.float32; they must match (nothing was written)"), case
        torch.testing.assert_close(buffer, torch.full((5,), -1.0), rtol=0, atol=0, msg=case)
    torch.testing.assert_close(received["after"], torch.arange(3.0), rtol=0, atol=0)
