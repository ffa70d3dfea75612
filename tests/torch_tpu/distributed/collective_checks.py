"""Rank body for the collective tests: every collective on ``tpu_dist`` and on gloo, same inputs.

Runs in the spawned ranks of conftest.py's job. Each check returns (ours, reference) as CPU tensors;
the test process compares them. "ours" runs on the default ``tpu_dist`` group with tensors on
``device``; the reference runs on a plain gloo group with CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

Check = Callable[[int, int, str, dist.ProcessGroup], object]
CHECKS: dict[str, Check] = {}

# Exact floats: with more than 2 ranks the reduction order differs between gloo and XLA, so
# float inputs are small multiples of 1/4 whose sums and products round nowhere.
EXACT_FLOATS = [False]


def split_matrix(size: int) -> list[list[int]]:
    """Row i: rows rank i sends to each rank (zeros included: a rank may send nothing)."""
    if size == 2:
        return [[1, 4], [3, 0]]
    return [[(3 * i + 2 * j) % 5 for j in range(size)] for i in range(size)]


def uneven_in(rank: int, size: int) -> list[int]:
    return split_matrix(size)[rank]


def uneven_out(rank: int, size: int) -> list[int]:
    return [row[rank] for row in split_matrix(size)]


def check(name: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS[name] = fn
        return fn

    return register


def _data(rank: int, *shape: int, dtype: torch.dtype = torch.float32, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point and EXACT_FLOATS[0]:
        return (torch.randint(-16, 16, shape, generator=g) / 4).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(*shape, generator=g).to(dtype)
    return torch.randint(1, 1 << 20, shape, generator=g, dtype=dtype)


def _cpu(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return [_cpu(v) for v in x]
    return x


_REDUCE_OPS = {
    "sum": (dist.ReduceOp.SUM, torch.float32),
    "avg": (dist.ReduceOp.AVG, torch.float32),
    "product": (dist.ReduceOp.PRODUCT, torch.float32),
    "min": (dist.ReduceOp.MIN, torch.float32),
    "max": (dist.ReduceOp.MAX, torch.float32),
    "band": (dist.ReduceOp.BAND, torch.int64),
    "bor": (dist.ReduceOp.BOR, torch.int64),
    "bxor": (dist.ReduceOp.BXOR, torch.int64),
    "sum_int32": (dist.ReduceOp.SUM, torch.int32),
    "sum_bf16": (dist.ReduceOp.SUM, torch.bfloat16),
}


def _allreduce_check(op: dist.ReduceOp, dtype: torch.dtype) -> Check:
    def run(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
        ours = _data(rank, 5, 3, dtype=dtype).to(device)
        ref = _data(rank, 5, 3, dtype=dtype)
        dist.all_reduce(ours, op=op)
        dist.all_reduce(ref, op=op, group=gloo)
        return ours, ref

    return run


for _name, (_op, _dtype) in _REDUCE_OPS.items():
    CHECKS[f"all_reduce_{_name}"] = _allreduce_check(_op, _dtype)


@check("all_reduce_premul_sum")
def _premul(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    ours = _data(rank, 7).to(device)
    dist.all_reduce(ours, op=dist._make_nccl_premul_sum(0.25))
    ref = _data(rank, 7) * 0.25
    dist.all_reduce(ref, group=gloo)
    return ours, ref


@check("all_reduce_strided_view_async")
def _strided(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    base = _data(rank, 4, 6).to(device)
    view = base.t()  # non-contiguous: results must land back in the base
    work = dist.all_reduce(view, async_op=True)
    work.wait()
    ref = _data(rank, 4, 6)
    dist.all_reduce(ref, group=gloo)
    return [base, work.get_future().value()[0]], [ref, ref.t()]


@check("all_reduce_coalesced")
def _ar_coalesced(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    ours = [_data(rank, n, salt=n).to(device) for n in (3, 1, 8)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ours:
            dist.all_reduce(t)
    cm.wait()
    refs = [_data(rank, n, salt=n) for n in (3, 1, 8)]
    for t in refs:
        dist.all_reduce(t, group=gloo)
    return ours, refs


@check("pair_subgroup_all_reduce")
def _pair_subgroups(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    """Groups (0, 1), (2, 3), ... (with 4 ranks: XLA programs over a part of the mesh)."""
    pairs = [dist.new_group([p, p + 1]) for p in range(0, size, 2)]  # every rank makes every group
    ours = _data(rank, 6).to(device)
    dist.all_reduce(ours, group=pairs[rank // 2])
    return ours, _data(rank, 6) + _data(rank ^ 1, 6)  # two operands: any order is exact


@check("broadcast")
def _broadcast(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    ours, ref = _data(rank, 9).to(device), _data(rank, 9)
    dist.broadcast(ours, src=1)
    dist.broadcast(ref, src=1, group=gloo)
    return ours, ref


@check("reduce")
def _reduce(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    ours, ref = _data(rank, 6).to(device), _data(rank, 6)
    dist.reduce(ours, dst=0, op=dist.ReduceOp.MAX)
    dist.reduce(ref, dst=0, op=dist.ReduceOp.MAX, group=gloo)
    return (ours, ref) if rank == 0 else (None, None)


@check("all_gather")
def _all_gather(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    ours = [torch.empty(2, 3, device=device) for _ in range(size)]
    refs = [torch.empty(2, 3) for _ in range(size)]
    dist.all_gather(ours, _data(rank, 2, 3).to(device))
    dist.all_gather(refs, _data(rank, 2, 3), group=gloo)
    return ours, refs


@check("all_gather_into_tensor")
def _all_gather_tensor(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    ours, ref = torch.empty(2 * size, 3, device=device), torch.empty(2 * size, 3)
    dist.all_gather_into_tensor(ours, _data(rank, 2, 3).to(device))
    dist.all_gather_into_tensor(ref, _data(rank, 2, 3), group=gloo)
    return ours, ref


@check("all_gather_into_tensor_coalesced")
def _all_gather_coalesced(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    shapes = [(2, 3), (5,), (1, 1)]
    ours = [torch.empty(size * s[0], *s[1:], device=device) for s in shapes]
    with dist._coalescing_manager(async_ops=True) as cm:
        for out, s in zip(ours, shapes):
            dist.all_gather_into_tensor(out, _data(rank, *s, salt=len(s)).to(device))
    cm.wait()
    refs = [torch.empty(size * s[0], *s[1:]) for s in shapes]
    for out, s in zip(refs, shapes):
        dist.all_gather_into_tensor(out, _data(rank, *s, salt=len(s)), group=gloo)
    return ours, refs


@check("reduce_scatter")
def _reduce_scatter(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    ours, ref = torch.empty(4, device=device), torch.empty(4)
    dist.reduce_scatter(ours, [_data(rank, 4, salt=r).to(device) for r in range(size)])
    dist.reduce_scatter(ref, [_data(rank, 4, salt=r) for r in range(size)], group=gloo)
    return ours, ref


@check("reduce_scatter_tensor_avg")
def _reduce_scatter_tensor(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    ours, ref = torch.empty(3, 2, device=device), torch.empty(3, 2)
    dist.reduce_scatter_tensor(ours, _data(rank, 3 * size, 2).to(device), op=dist.ReduceOp.AVG)
    dist.reduce_scatter_tensor(ref, _data(rank, 3 * size, 2), op=dist.ReduceOp.AVG, group=gloo)
    return ours, ref


@check("reduce_scatter_tensor_coalesced")
def _reduce_scatter_coalesced(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    sizes = [3, 1, 6]
    ours = [torch.empty(n, device=device) for n in sizes]
    with dist._coalescing_manager(async_ops=True) as cm:
        for out, n in zip(ours, sizes):
            dist.reduce_scatter_tensor(out, _data(rank, size * n, salt=n).to(device))
    cm.wait()
    refs = [torch.empty(n) for n in sizes]
    for out, n in zip(refs, sizes):
        dist.reduce_scatter_tensor(out, _data(rank, size * n, salt=n), group=gloo)
    return ours, refs


@check("all_to_all_single_even")
def _a2a_even(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    ours, ref = torch.empty(2 * size, 3, device=device), torch.empty(2 * size, 3)
    dist.all_to_all_single(ours, _data(rank, 2 * size, 3).to(device))
    dist.all_to_all_single(ref, _data(rank, 2 * size, 3), group=gloo)
    return ours, ref


@check("all_to_all_single_equal_splits")
def _a2a_equal_splits(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    """Splits passed, all equal (the XLA transport's no-padding path after the split exchange)."""
    splits = [3] * size
    ours, ref = torch.empty(3 * size, 2, device=device), torch.empty(3 * size, 2)
    dist.all_to_all_single(ours, _data(rank, 3 * size, 2).to(device), splits, splits)
    dist.all_to_all_single(ref, _data(rank, 3 * size, 2), splits, splits, group=gloo)
    return ours, ref


@check("all_to_all_single_uneven")
def _a2a_uneven(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    ins, outs = uneven_in(rank, size), uneven_out(rank, size)
    x = _data(rank, sum(ins), 2, dtype=torch.int64)
    ours, ref = torch.empty(sum(outs), 2, dtype=torch.int64, device=device), torch.empty(
        sum(outs), 2, dtype=torch.int64
    )
    dist.all_to_all_single(ours, x.to(device), outs, ins)
    dist.all_to_all_single(ref, x, outs, ins, group=gloo)
    return ours, ref


@check("all_to_all_list_uneven")
def _a2a_list(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    sent, received = uneven_in(rank, size), uneven_out(rank, size)
    ins = [_data(rank, n, salt=i) for i, n in enumerate(sent)]
    ours = [torch.empty(n, device=device) for n in received]
    dist.all_to_all(ours, [t.to(device) for t in ins])
    # gloo's list all_to_all rejects uneven sizes; its flat form with splits is the reference.
    ref = torch.empty(sum(received))
    dist.all_to_all_single(ref, torch.cat(ins), received, sent, group=gloo)
    return ours, list(ref.split(received))


@check("functional_all_to_all_single_uneven")
def _funcol_a2a(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    ins, outs = uneven_in(rank, size), uneven_out(rank, size)
    x = _data(rank, sum(ins), 4)
    ours = funcol.wait_tensor(
        funcol.all_to_all_single(x.to(device), outs, ins, dist.group.WORLD)
    )
    ref = torch.empty(sum(outs), 4)
    dist.all_to_all_single(ref, x, outs, ins, group=gloo)
    return ours, ref


@check("functional_all_gather_reduce_scatter")
def _funcol_ag_rs(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    x = _data(rank, 2, 5)
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(x.to(device), 0, dist.group.WORLD))
    scattered = funcol.wait_tensor(
        funcol.reduce_scatter_tensor(gathered * (rank + 1), "sum", 0, dist.group.WORLD)
    )
    ref_g = torch.empty(2 * size, 5)
    dist.all_gather_into_tensor(ref_g, x, group=gloo)
    ref_s = torch.empty(2, 5)
    dist.reduce_scatter_tensor(ref_s, ref_g * (rank + 1), group=gloo)
    return [gathered, scattered], [ref_g, ref_s]


@check("scatter")
def _scatter(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    chunks = [_data(7, 3, salt=r) for r in range(size)] if rank == 1 else None
    ours, ref = torch.empty(3, device=device), torch.empty(3)
    dist.scatter(ours, [c.to(device) for c in chunks] if chunks else None, src=1)
    dist.scatter(ref, chunks, src=1, group=gloo)
    return ours, ref


@check("gather")
def _gather(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    x = _data(rank, 4)
    ours = [torch.empty(4, device=device) for _ in range(size)] if rank == 1 else None
    refs = [torch.empty(4) for _ in range(size)] if rank == 1 else None
    dist.gather(x.to(device), ours, dst=1)
    dist.gather(x, refs, dst=1, group=gloo)
    return ours, refs


@check("send_recv")
def _send_recv(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    peer = rank ^ 1  # pairs (0, 1), (2, 3), ...
    results = []
    for group, dev in ((None, device), (gloo, "cpu")):
        mine, theirs = _data(rank, 5).to(dev), torch.empty(5, device=dev)
        ops = [dist.P2POp(dist.isend, mine, peer, group), dist.P2POp(dist.irecv, theirs, peer, group)]
        for work in dist.batch_isend_irecv(ops if rank % 2 == 0 else ops[::-1]):
            work.wait()
        results.append(theirs)
    return results[0], results[1]


@check("barrier_and_objects")
def _objects(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    dist.barrier()
    ours: list[object] = [None] * size
    refs: list[object] = [None] * size
    payload = {"rank": rank, "ids": list(range(rank + 2))}
    dist.all_gather_object(ours, payload)
    dist.all_gather_object(refs, payload, group=gloo)
    box = [payload] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    return [ours, box], [refs, [{"rank": 0, "ids": [0, 1]}]]


@check("host_and_device_lanes")
def _lanes(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> object:
    """A tpu and a cpu all_reduce issued in opposite orders on even and odd ranks (as autograd's
    device thread and the caller's thread may issue them) both complete: each lane has one order.
    (cpu tensors only share one lane, so that job keeps one order.)"""
    host, ref_host = _data(rank, 4), _data(rank, 4)
    moved, ref_moved = _data(rank, 3, salt=1).to(device), _data(rank, 3, salt=1)
    issue = [lambda: dist.all_reduce(host, async_op=True), lambda: dist.all_reduce(moved, async_op=True)]
    flipped = device == "tpu" and rank % 2 == 1
    for work in [start() for start in (issue[::-1] if flipped else issue)]:
        work.wait()
    dist.all_reduce(ref_host, group=gloo)
    dist.all_reduce(ref_moved, group=gloo)
    return [host, moved], [ref_host, ref_moved]


def run_checks(rank: int, size: int, device: str, gloo: dist.ProcessGroup) -> dict:
    """Every check as name -> (ours, reference) on CPU, or name -> error text."""
    EXACT_FLOATS[0] = size > 2
    results: dict[str, object] = {}
    for name, fn in CHECKS.items():
        try:
            results[name] = _cpu(fn(rank, size, device, gloo))
        except Exception as exc:  # reported per check by the test, with the rank
            results[name] = f"{type(exc).__name__}: {exc}"
    return results
