"""Data movement behind the ``tpu_dist`` process group.

``ProcessGroupTPU`` reduces every c10d collective to the flat primitives of :class:`Transport`
(one tensor in, one tensor out, splits along dim 0). :class:`GlooTransport` runs them over the
host network with an internal gloo process group on host copies of the data;
:class:`~torch_tpu.distributed.xla_transport.XlaTransport` runs them as XLA collectives on the
tensors' JAX arrays (ICI on a TPU slice) and wraps a gloo transport for CPU tensors.

Transport calls are synchronous and are issued by one worker thread per group, in issue order,
so an implementation never sees two calls at once and every rank sees the same call sequence.
"""

from __future__ import annotations

import abc
import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store

from torch_tpu.distributed.shm_reduce import SharedMemoryReduce
from torch_tpu.distributed.worker import Deadline, RefusedError
from torch_tpu.runtime.dtypes import dtype_code, dtype_of_code

ReduceOp = dist.ReduceOp


class Transport(abc.ABC):
    """Synchronous collectives over dense tensors of one group (``rank`` of ``size``)."""

    name: str  # "gloo", "xla": what :func:`torch_tpu.distributed.active_transport` reports
    rank: int
    size: int
    # a limit the group's worker enforces on each job (calls that could block forever otherwise)
    deadline: Deadline | None = None

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        """In place; ``op`` is SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR or PREMUL_SUM."""

    @abc.abstractmethod
    def reduce(self, tensor: torch.Tensor, root: int, op: dist.ReduceOp) -> None:
        """In place on ``root``; other ranks' ``tensor`` is left unspecified."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """In place: every rank ends with ``root``'s value."""

    @abc.abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` (``size * input.numel()`` elements) receives the inputs in rank order."""

    @abc.abstractmethod
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp) -> None:
        """Reduce ``input`` (``size`` equal chunks) and keep chunk ``rank`` in ``output``."""

    @abc.abstractmethod
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
    ) -> None:
        """Rows ``input_splits[r]`` go to rank r; rows from rank r land in ``output_splits[r]``.

        Both splits empty: equal chunks of dim 0 on every rank (no split exchange needed).
        """

    @abc.abstractmethod
    def gather(self, outputs: list[torch.Tensor] | None, input: torch.Tensor, root: int) -> None:
        """``root`` receives every rank's ``input`` into ``outputs`` (None elsewhere)."""

    @abc.abstractmethod
    def scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> None:
        """Rank r receives ``root``'s ``inputs[r]`` (None on other ranks)."""

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None: ...

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        """Into ``tensor``, which must hold as many elements of the dtype as were sent; otherwise
        the message is consumed and :class:`RefusedError` names both (the group stays usable)."""

    @abc.abstractmethod
    def barrier(self) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release connections; later calls are an error."""


class _HostCopy:
    """A contiguous CPU tensor standing in for ``tensor`` while gloo works on it.

    CPU tensors that are already contiguous are used directly (gloo writes them in place); others
    (tpu tensors, strided views) are copied to the host and written back by :meth:`write_back`.
    """

    def __init__(self, tensor: torch.Tensor, *, read: bool = True) -> None:
        self.tensor = tensor
        self.direct = tensor.device.type == "cpu" and tensor.is_contiguous()
        if self.direct:
            self.host = tensor.detach()
        elif read:
            self.host = tensor.detach().to("cpu").contiguous()
        else:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype)

    def write_back(self) -> None:
        if not self.direct:
            with torch.no_grad():
                self.tensor.copy_(self.host)


def _host_inputs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [_HostCopy(t).host for t in tensors]


def _reduce_options(op: dist.ReduceOp, cls: type) -> tuple[object, dist.ReduceOp, float | None]:
    """gloo options for ``op`` plus the post-scale AVG / PREMUL_SUM need (gloo has neither)."""
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    opts = cls()
    if kind == ReduceOp.RedOpType.AVG:
        opts.reduceOp = ReduceOp.SUM
        return opts, ReduceOp.AVG, None
    if kind == ReduceOp.RedOpType.PREMUL_SUM:
        opts.reduceOp = ReduceOp.SUM
        return opts, ReduceOp.PREMUL_SUM, float(op.factor)
    opts.reduceOp = ReduceOp(kind)
    return opts, ReduceOp.SUM, None


def _scale_before(host: torch.Tensor, kind: dist.ReduceOp, factor: float | None) -> torch.Tensor:
    if kind != ReduceOp.PREMUL_SUM:
        return host
    if not host.is_floating_point():
        raise TypeError(f"PREMUL_SUM needs a floating-point tensor, got {host.dtype}")
    return host * factor


def _scale_after(host: torch.Tensor, kind: dist.ReduceOp, size: int) -> None:
    if kind == ReduceOp.AVG:
        if host.is_floating_point() or host.is_complex():
            host.div_(size)
        else:
            host.copy_(torch.div(host, size, rounding_mode="trunc"))


def refused_receive(tensor: torch.Tensor, src: int, tag: int, sent: tuple[int, torch.dtype]) -> RefusedError:
    """The error of a receive whose buffer is not what ``src`` sent (``sent``: count, dtype)."""
    return RefusedError(
        f"tpu_dist recv: rank {src} sent {sent[0]} elements of {sent[1]} (tag {tag}), the receive buffer holds "
        f"{tensor.numel()} of {tensor.dtype}; they must match (nothing was written)")


class GlooTransport(Transport):
    """Collectives over an internal gloo process group on host copies (loopback or host network)."""

    name = "gloo"

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        prefix: str = "tpu_dist_gloo",
    ) -> None:
        """Connects to the peers (every rank constructs it); ``prefix`` tells apart the gloo
        contexts of one group in ``store``."""
        self.rank = rank
        self.size = size
        self._gloo = ProcessGroupGloo(PrefixStore(prefix, store), rank, size, timeout)
        # large sums of ranks on one host go through shared memory, not TCP loopback
        self._shared = SharedMemoryReduce.connect(PrefixStore(prefix, store), rank, size, timeout) if size > 1 else None

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        self._reduce_into(tensor, op, root=None)

    def reduce(self, tensor: torch.Tensor, root: int, op: dist.ReduceOp) -> None:
        self._reduce_into(tensor, op, root=root)

    def _reduce_into(self, tensor: torch.Tensor, op: dist.ReduceOp, root: int | None) -> None:
        cls = dist.AllreduceOptions if root is None else dist.ReduceOptions
        opts, kind, factor = _reduce_options(op, cls)
        copy = _HostCopy(tensor)
        staged = _scale_before(copy.host, kind, factor)
        if root is None:
            shared = self._shared is not None and opts.reduceOp == ReduceOp.SUM and self._shared.takes(staged)
            if not (shared and self._shared.all_reduce_sum(staged)):
                self._gloo.allreduce([staged], opts).wait()
        else:
            opts.rootRank = root
            self._gloo.reduce([staged], opts).wait()
        _scale_after(staged, kind, self.size)
        if staged is not copy.host:
            copy.host.copy_(staged)
        copy.write_back()

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        copy = _HostCopy(tensor, read=self.rank == root)
        self._gloo.broadcast([copy.host], opts).wait()
        copy.write_back()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        out = _HostCopy(output, read=False)
        self._gloo._allgather_base(out.host, _host_inputs([input])[0]).wait()
        out.write_back()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp) -> None:
        opts, kind, factor = _reduce_options(op, dist.ReduceScatterOptions)
        out = _HostCopy(output, read=False)
        staged = _scale_before(_host_inputs([input])[0], kind, factor)
        self._gloo._reduce_scatter_base(out.host, staged, opts).wait()
        _scale_after(out.host, kind, self.size)
        out.write_back()

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
    ) -> None:
        out = _HostCopy(output, read=False)
        self._gloo.alltoall_base(
            out.host, _host_inputs([input])[0], list(output_splits), list(input_splits),
            dist.AllToAllOptions(),
        ).wait()
        out.write_back()

    def gather(self, outputs: list[torch.Tensor] | None, input: torch.Tensor, root: int) -> None:
        opts = dist.GatherOptions()
        opts.rootRank = root
        outs = [_HostCopy(t, read=False) for t in outputs or []]
        lists = [[o.host for o in outs]] if outputs is not None else []
        self._gloo.gather(lists, _host_inputs([input]), opts).wait()
        for o in outs:
            o.write_back()

    def scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> None:
        opts = dist.ScatterOptions()
        opts.rootRank = root
        out = _HostCopy(output, read=False)
        lists = [_host_inputs(inputs)] if inputs is not None else []
        self._gloo.scatter([out.host], lists, opts).wait()
        out.write_back()

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.announce(tensor, dst, tag)
        self._gloo.send(_host_inputs([tensor]), dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        sent = self.announced(tensor, src, tag)
        if sent is not None:
            numel, dtype = sent
            self._gloo.recv([torch.empty(numel, dtype=dtype)], src, tag).wait()
            raise refused_receive(tensor, src, tag, sent)
        out = _HostCopy(tensor, read=False)
        self._gloo.recv([out.host], src, tag).wait()
        out.write_back()

    def announce(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Tell ``dst`` what the next message of ``tag`` holds (see :meth:`announced`)."""
        header = torch.tensor([tensor.numel(), dtype_code(tensor.dtype)], dtype=torch.int64)
        self._gloo.send([header], dst, tag).wait()

    def announced(self, tensor: torch.Tensor, src: int, tag: int) -> tuple[int, torch.dtype] | None:
        """None when ``src``'s next message of ``tag`` fits ``tensor`` exactly; else its element
        count and dtype (gloo would fill a larger buffer's head and leave the rest as it was)."""
        header = torch.empty(2, dtype=torch.int64)
        self._gloo.recv([header], src, tag).wait()
        numel, code = header.tolist()
        dtype = dtype_of_code(code)
        return None if (numel, dtype) == (tensor.numel(), tensor.dtype) else (numel, dtype)

    def barrier(self) -> None:
        self._gloo.barrier(dist.BarrierOptions()).wait()

    def shutdown(self) -> None:
        self._gloo.shutdown()
        if self._shared is not None:
            self._shared.close()
