"""TorchTPU 0.2.0's collective ``tpu::`` ops over ``torch.distributed`` (any backend: tpu_dist
on tpu tensors, gloo on CPU ones), groups named by ``ProcessGroup.group_name``.

* ``_all_gather_dim`` / ``_reduce_scatter_dim``: along any dim, over the functional collectives
  ``_c10d_functional.all_gather_into_tensor`` / ``reduce_scatter_tensor`` (dim 0) with the dim
  moved first: they run eagerly and inside ``torch.compile(backend="tpu")`` graphs, which lower
  functional collectives. No autograd (as TorchTPU).
* ``_ragged_all_to_all`` / ``.out``: each rank sends ``operand[input_offsets[j]:][:send_sizes[j]]``
  to rank ``j``, which writes it into its copy of ``output`` at row ``output_offsets[j]`` (the
  offset the sender names). Eager only: the sizes are read to the host and checked against every
  peer's (counts each way, row shape and dtype, bounds), then the rows exchanged with one
  ``all_to_all_single``; a plan any rank refuses raises on every rank before a row moves (gloo would
  abort the process on mismatched counts). Differentiable in ``operand`` (the backward sends the
  gradient rows back).
* ``_send`` / ``_recv``: point-to-point over the default group; each completes the transfer before
  it returns (TorchTPU's may still be in flight) and returns a boxed, completed ``Work``
  (``torch._C._distributed_c10d.Work.unbox``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torch_tpu.runtime.dtypes import dtype_code, dtype_of_code

SCHEMAS = {
    "_all_gather_dim": "(Tensor input, int dim, int group_size, str group_name) -> Tensor",
    "_reduce_scatter_dim": "(Tensor input, str reduce_op, int dim, int group_size, str group_name) -> Tensor",
    "_ragged_all_to_all": "(Tensor operand, Tensor output, Tensor input_offsets, Tensor send_sizes, "
                          "Tensor output_offsets, Tensor recv_sizes, str process_group_name) -> Tensor",
    "_ragged_all_to_all.out": "(Tensor operand, Tensor output, Tensor input_offsets, Tensor send_sizes, "
                              "Tensor output_offsets, Tensor recv_sizes, str process_group_name, *, "
                              "Tensor(a!) out) -> Tensor(a!)",
    "_send": "(Tensor[] tensors, int dst, int tag) -> Any",
    "_recv": "(Tensor[] tensors, int src, int tag) -> Any",
}
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
_c10d = torch.ops._c10d_functional


def _all_gather_dim(x: torch.Tensor, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    if x.dim() == 0:
        raise ValueError("tpu::_all_gather_dim: input must have at least one dimension")
    moved = x.movedim(dim, 0).contiguous()
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(moved, group_size, group_name))
    return gathered.movedim(0, dim)  # the ranks' blocks one after another along dim


def _reduce_scatter_dim(x: torch.Tensor, reduce_op: str, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"tpu::_reduce_scatter_dim: reduce_op {reduce_op!r} is not one of {list(REDUCE_OPS)}")
    if reduce_op.startswith("b") and (x.dtype.is_floating_point or x.dtype.is_complex):
        raise ValueError(f"tpu::_reduce_scatter_dim: reduce_op {reduce_op!r} needs an integer dtype, got {x.dtype}")
    if x.dim() == 0 or x.shape[dim] % group_size:
        raise ValueError(f"tpu::_reduce_scatter_dim: input size {x.shape[dim] if x.dim() else 0} along dim {dim} is "
                         f"not divisible by the group size {group_size}")
    moved = x.movedim(dim, 0).contiguous()
    out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(moved, reduce_op, group_size, group_name))
    return out.movedim(0, dim)


def _group(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(f"process group {name!r} is not a registered group of this process ({e})") from None


def _host_ints(t: torch.Tensor, what: str, ranks: int) -> list[int]:
    if t.dim() != 1 or t.numel() != ranks:
        raise ValueError(f"{what} must be 1-D with one entry per rank ({ranks}), got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex():
        raise ValueError(f"{what} must hold integers, got {t.dtype}")
    return [int(v) for v in t.cpu().tolist()]


def _exchange(operand: torch.Tensor, output: torch.Tensor, plan: tuple[list[int], ...],
              group: dist.ProcessGroup) -> torch.Tensor:
    """The rows each rank sends (``plan``: input offsets, send sizes, where the senders put their
    rows in this rank's output, receive sizes) exchanged, written into a copy of ``output``."""
    in_off, send, their_off, recv = plan
    send_buf = torch.cat([operand.narrow(0, o, n) for o, n in zip(in_off, send)])
    recv_buf = operand.new_empty((sum(recv), *operand.shape[1:]))
    dist.all_to_all_single(recv_buf, send_buf, output_split_sizes=recv, input_split_sizes=send, group=group)
    result, start = output.clone(), 0
    for o, n in zip(their_off, recv):
        result[o:o + n] = recv_buf[start:start + n]
        start += n
    return result


class _RaggedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, operand, output, plan, group):
        ctx.plan, ctx.group, ctx.shape = plan, group, operand.shape
        return _exchange(operand, output, plan, group)

    @staticmethod
    def backward(ctx, grad):
        in_off, send, their_off, recv = ctx.plan
        # each received row's gradient goes back to the row it was sent from
        back = (their_off, recv, in_off, send)
        zeros = grad.new_zeros(ctx.shape)
        return _exchange(grad, zeros, back, ctx.group), None, None, None


def _local_error(operand: torch.Tensor, output: torch.Tensor, in_off: list[int], send: list[int],
                 recv: list[int]) -> str | None:
    if operand.dim() == 0 or operand.shape[1:] != output.shape[1:] or operand.dtype != output.dtype:
        return (f"operand {tuple(operand.shape)} {operand.dtype} and output {tuple(output.shape)} {output.dtype} "
                "must have rows, of one shape and dtype")
    for j in range(len(send)):
        if in_off[j] < 0 or send[j] < 0 or in_off[j] + send[j] > operand.shape[0]:
            return (f"rows [{in_off[j]}, {in_off[j] + send[j]}) for rank {j} are outside operand's "
                    f"{operand.shape[0]} rows")
        if recv[j] < 0:
            return f"recv_sizes[{j}] is {recv[j]}; a row count is >= 0"
    return None


def _pair_error(rank: int, output: torch.Tensor, mine: list[list[int]], theirs: list[list[int]]) -> str | None:
    """What this rank's plan (``mine``, a row per peer) and each peer's (``theirs``: the row it
    sent here) disagree on: a row width, a dtype, a row count, or rows outside ``output``. Peers
    that refused their own plan are left out (they say why)."""
    for j, ((_, send, recv, width, dtype, _), (their_off, their_send, their_recv, their_width, their_dtype, refused)) \
            in enumerate(zip(mine, theirs)):
        if refused:
            continue
        if (their_width, their_dtype) != (width, dtype):
            return (f"rank {j}'s rows are {dtype_of_code(their_dtype)} with {their_width} elements, this rank's "
                    f"{dtype_of_code(dtype)} with {width}; every rank's operand and output must match")
        if their_send != recv:
            return (f"recv_sizes[{j}] is {recv} on rank {rank}, but rank {j} sends it {their_send} rows "
                    f"(its send_sizes[{rank}])")
        if their_recv != send:
            return (f"send_sizes[{j}] is {send} on rank {rank}, but rank {j} receives {their_recv} rows from it "
                    f"(its recv_sizes[{rank}])")
        if their_off < 0 or their_off + recv > output.shape[0]:
            return f"rows [{their_off}, {their_off + recv}) from rank {j} are outside output's {output.shape[0]} rows"
    return None


def _plan(operand, output, sizes: tuple[torch.Tensor, ...], group: dist.ProcessGroup) -> tuple[list[int], ...]:
    """(input offsets, send sizes, where each sender puts its rows here, receive sizes), checked
    against every peer's before a row moves: a plan any rank refuses fails on every rank (with its
    own reason there and the refusing ranks elsewhere), so no rank is left in a mismatched exchange."""
    ranks, rank = group.size(), group.rank()
    names = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
    try:
        in_off, send, out_off, recv = (_host_ints(t, name, ranks) for t, name in zip(sizes, names, strict=True))
        error = _local_error(operand, output, in_off, send, recv)
    except ValueError as e:
        in_off = send = out_off = recv = [0] * ranks
        error = str(e)
    width, dtype = (operand[0].numel() if operand.dim() else 0), dtype_code(operand.dtype)
    mine = [[out_off[j], send[j], recv[j], width, dtype, error is not None] for j in range(ranks)]
    theirs = torch.empty((ranks, len(mine[0])), dtype=torch.int64, device=operand.device)
    dist.all_to_all_single(theirs, torch.tensor(mine, dtype=torch.int64, device=operand.device), group=group)
    theirs_rows = theirs.cpu().tolist()
    error = error or _pair_error(rank, output, mine, theirs_rows)
    refused = torch.zeros(ranks, dtype=torch.int64, device=operand.device)
    refused[rank] = error is not None
    dist.all_reduce(refused, group=group)
    if error is not None:
        raise ValueError(f"tpu::_ragged_all_to_all: {error}")
    if refused.any():
        who = [j for j, bad in enumerate(refused.cpu().tolist()) if bad]
        raise ValueError(f"tpu::_ragged_all_to_all: rank(s) {who} refused the exchange (see their error); "
                         "no rows were sent")
    return in_off, send, [row[0] for row in theirs_rows], recv


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, process_group_name):
    group = _group(process_group_name)
    plan = _plan(operand, output, (input_offsets, send_sizes, output_offsets, recv_sizes), group)
    return _RaggedAllToAll.apply(operand, output, plan, group)


def _ragged_all_to_all_out(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                           process_group_name, *, out):
    return out.copy_(_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                        process_group_name))


def _p2p(send: bool):
    def kernel(tensors: list[torch.Tensor], peer: int, tag: int) -> object:
        if not dist.is_initialized():
            raise RuntimeError(f"tpu::_{'send' if send else 'recv'}: torch.distributed is not initialized "
                               "(init_process_group first)")
        ops = [dist.P2POp(dist.isend if send else dist.irecv, t, peer, tag=tag) for t in tensors]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()  # (gloo's point-to-point works have no futures to chain)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(list(tensors))
        return torch._C._distributed_c10d._create_work_from_future(done).boxed()

    return kernel


def kernels() -> dict[str, Callable[..., Any]]:
    """Each op's CompositeImplicitAutograd kernel, by its :data:`SCHEMAS` name."""
    return {"_all_gather_dim": _all_gather_dim, "_reduce_scatter_dim": _reduce_scatter_dim,
            "_ragged_all_to_all": _ragged_all_to_all, "_ragged_all_to_all.out": _ragged_all_to_all_out,
            "_send": _p2p(True), "_recv": _p2p(False)}
