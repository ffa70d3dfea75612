"""``ProcessGroupTPU``: the c10d process group behind ``init_process_group("tpu_dist")``.

A Python ``dist.ProcessGroup`` subclass. Every collective validates its arguments on the caller
(clear errors naming the collective, the bad value and the limit), then queues a job on the
group's ordered worker and returns an async ``Work``. Jobs reduce list-, coalesced- and
multi-tensor forms to the flat primitives of a :class:`~torch_tpu.distributed.transport.Transport`.

A group has two lanes when it is given a ``device_transport``: collectives on tpu tensors run
in issue order on the device lane (its own worker and transport), all others (cpu tensors, mixed
calls, barrier) on the host lane. So one group carries both a model's device traffic (DDP, FSDP2 on
tpu) and its host traffic (the sparse engine's id and embedding all_to_alls, checkpoint
collectives) even when autograd issues them from different threads (it runs tpu backward on a
device thread and cpu backward on the caller's), whose relative order differs between ranks: each
lane's order is the same on every rank. A failure on either lane poisons both.

Method names follow torch 2.13 (``all_gather_single``, ``reduce_scatter_single``,
``all_to_all_single`` and their ``_coalesced`` forms); the pre-2.13 names (``_allgather_base``,
``_reduce_scatter_base``, ``alltoall_base``, ``allgather_into_tensor_coalesced``,
``reduce_scatter_tensor_coalesced``) are aliases, so callers of either generation work.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torch_tpu.distributed.transport import Transport
from torch_tpu.distributed.worker import Failure, FutureWork, OrderedWorker

BACKEND_NAME = "tpu_dist"


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _copy_pieces(flat: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    for out, piece in zip(outputs, flat.split([t.numel() for t in outputs]), strict=True):
        out.copy_(piece.view(out.shape))


def _on_device(tensors: Sequence[torch.Tensor]) -> bool:
    return bool(tensors) and all(t.device.type == "tpu" for t in tensors)


class ProcessGroupTPU(dist.ProcessGroup):
    """c10d process group for tpu and cpu tensors over a :class:`Transport` (``transport``; with a
    ``device_transport``, that one carries the collectives on tpu tensors on a lane of its own)."""

    def __init__(
        self,
        transport: Transport,
        timeout: datetime.timedelta,
        global_ranks: Sequence[int] | None = None,
        device_transport: Transport | None = None,
    ) -> None:
        super().__init__(transport.rank, transport.size)
        self._transport = transport
        self._device_transport = device_transport
        self._rank = transport.rank
        self._size = transport.size
        self._timeout = timeout
        self._global_ranks = list(global_ranks) if global_ranks else list(range(self._size))
        self._group_name = ""
        self._group_desc = ""
        failure = Failure()
        self._worker = OrderedWorker(f"tpu_dist-r{self._rank}", failure, transport.deadline)
        self._device_worker = (
            OrderedWorker(f"tpu_dist-device-r{self._rank}", failure, device_transport.deadline)
            if device_transport else None
        )

    # ---- identity ---------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 -- c10d's virtual method name
        return BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def transport_name(self) -> str:
        """The transport tpu tensors travel through: "xla" or "gloo"."""
        return (self._device_transport or self._transport).name

    def __repr__(self) -> str:
        return (
            f"ProcessGroupTPU(name={self._group_name!r}, rank={self._rank}, size={self._size}, "
            f"transport={type(self._device_transport or self._transport).__name__})"
        )

    # ---- plumbing ---------------------------------------------------------------------------

    def _submit(
        self, collective: str, tensors: Sequence[torch.Tensor], job: Callable[[Transport], Any]
    ) -> FutureWork:
        """Queue ``job(transport)`` on the lane of ``tensors`` (device lane: all on tpu)."""
        if self._device_worker is not None and _on_device(tensors):
            worker, transport = self._device_worker, self._device_transport
        else:
            worker, transport = self._worker, self._transport

        def describe(exc: BaseException) -> str:
            return (
                f"tpu_dist {collective} failed on group {self._group_name!r} (rank {self._rank} of "
                f"{self._size}, global ranks {self._global_ranks}, timeout "
                f"{self._timeout.total_seconds():g}s): {type(exc).__name__}: {exc}. A peer rank "
                "exited or did not join this collective in time, or the ranks issued different "
                "collectives; this group cannot be used any more."
            )

        return worker.submit(collective, lambda: job(transport), describe)

    def _each(
        self,
        collective: str,
        tensors: list[torch.Tensor],
        run: Callable[[Transport, torch.Tensor], None],
    ) -> FutureWork:
        """One job running ``run`` on every tensor in order; the tensors are the result."""

        def job(transport: Transport) -> list[torch.Tensor]:
            for t in tensors:
                run(transport, t)
            return tensors

        return self._submit(collective, tensors, job)

    def _check_rank(self, collective: str, what: str, rank: int) -> None:
        if not 0 <= rank < self._size:
            raise ValueError(
                f"tpu_dist {collective}: {what} {rank} is not a rank of this group "
                f"(size {self._size})"
            )

    def _check_list(self, collective: str, what: str, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != self._size:
            raise ValueError(
                f"tpu_dist {collective}: {what} has {len(tensors)} tensors; the group has "
                f"{self._size} ranks and needs one per rank"
            )

    @staticmethod
    def _check_like(collective: str, what: str, tensor: torch.Tensor, ref: torch.Tensor) -> None:
        if tensor.dtype != ref.dtype or tensor.numel() != ref.numel():
            raise ValueError(
                f"tpu_dist {collective}: {what} is {tensor.dtype}[{tensor.numel()}], expected "
                f"{ref.dtype}[{ref.numel()}] like the input"
            )

    def _check_multiple(
        self, collective: str, big: torch.Tensor, small: torch.Tensor, big_name: str
    ) -> None:
        if big.dtype != small.dtype:
            raise ValueError(
                f"tpu_dist {collective}: input and output dtypes differ ({big.dtype} vs "
                f"{small.dtype})"
            )
        if big.numel() != self._size * small.numel():
            raise ValueError(
                f"tpu_dist {collective}: {big_name} has {big.numel()} elements, expected group "
                f"size {self._size} x {small.numel()} = {self._size * small.numel()}"
            )

    def _root_list(
        self,
        collective: str,
        root: int,
        single: list[torch.Tensor],
        lists: list[list[torch.Tensor]],
        single_name: str,
        list_name: str,
    ) -> list[torch.Tensor] | None:
        """Validate a rooted collective; the root's per-rank list (None on other ranks)."""
        self._check_rank(collective, "root", root)
        if len(single) != 1:
            raise ValueError(
                f"tpu_dist {collective}: expects one {single_name} tensor, got {len(single)}"
            )
        per_rank = lists[0] if self._rank == root else None
        if per_rank is not None:
            self._check_list(collective, f"{list_name} list on the root", per_rank)
            for r, t in enumerate(per_rank):
                self._check_like(collective, f"{list_name} for rank {r}", t, single[0])
        return per_rank

    # ---- reductions -------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = (opts or dist.AllreduceOptions()).reduceOp
        return self._each("allreduce", tensors, lambda transport, t: transport.all_reduce(t, op))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = (opts or dist.AllreduceCoalescedOptions()).reduceOp
        if len({(t.dtype, t.device) for t in tensors}) > 1:
            raise ValueError(
                "tpu_dist allreduce_coalesced: all tensors must share dtype and device, got "
                f"{sorted({f'{t.dtype}@{t.device}' for t in tensors})}"
            )

        def job(transport: Transport) -> list[torch.Tensor]:
            flat = _flat(tensors)
            transport.all_reduce(flat, op)
            _copy_pieces(flat, tensors)
            return tensors

        return self._submit("allreduce_coalesced", tensors, job)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceOptions()
        root, op = opts.rootRank, opts.reduceOp
        self._check_rank("reduce", "root", root)
        return self._each("reduce", tensors, lambda transport, t: transport.reduce(t, root, op))

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        op = (opts or dist.ReduceScatterOptions()).reduceOp
        for out, inputs in zip(outputs, input_lists, strict=True):
            self._check_list("reduce_scatter", "input list", inputs)
            for r, t in enumerate(inputs):
                self._check_like("reduce_scatter", f"input for rank {r}", t, out)

        def job(transport: Transport) -> list[torch.Tensor]:
            for out, inputs in zip(outputs, input_lists, strict=True):
                transport.reduce_scatter(out, _flat(inputs), op)
            return outputs

        return self._submit("reduce_scatter", [*outputs, *(t for ts in input_lists for t in ts)], job)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        op = (opts or dist.ReduceScatterOptions()).reduceOp
        self._check_multiple("reduce_scatter_single", input, output, "input")

        def job(transport: Transport) -> list[torch.Tensor]:
            transport.reduce_scatter(output, input, op)
            return [output]

        return self._submit("reduce_scatter_single", [output, input], job)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        op = (opts or dist.ReduceScatterOptions()).reduceOp
        for out, inp in zip(outputs, inputs, strict=True):
            self._check_multiple("reduce_scatter_single_coalesced", inp, out, "input")

        def job(transport: Transport) -> list[torch.Tensor]:
            # Rank r's chunk of every input, side by side, so one reduce-scatter serves all.
            by_rank = torch.cat([t.reshape(self._size, -1) for t in inputs], dim=1)
            flat_out = torch.empty(
                by_rank.shape[1], dtype=by_rank.dtype, device=by_rank.device
            )
            transport.reduce_scatter(flat_out, by_rank.reshape(-1), op)
            _copy_pieces(flat_out, outputs)
            return outputs

        return self._submit("reduce_scatter_single_coalesced", [*outputs, *inputs], job)

    # ---- data movement ----------------------------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        root = (opts or dist.BroadcastOptions()).rootRank
        self._check_rank("broadcast", "root", root)
        return self._each("broadcast", tensors, lambda transport, t: transport.broadcast(t, root))

    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        for outs, inp in zip(output_lists, inputs, strict=True):
            self._check_list("allgather", "output list", outs)
            for r, t in enumerate(outs):
                self._check_like("allgather", f"output for rank {r}", t, inp)

        def job(transport: Transport) -> list[list[torch.Tensor]]:
            for outs, inp in zip(output_lists, inputs, strict=True):
                flat = torch.empty(self._size * inp.numel(), dtype=inp.dtype, device=inp.device)
                transport.all_gather(flat, inp.reshape(-1))
                _copy_pieces(flat, outs)
            return output_lists

        return self._submit("allgather", [*inputs, *(t for ts in output_lists for t in ts)], job)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        self._check_multiple("all_gather_single", output, input, "output")

        def job(transport: Transport) -> list[torch.Tensor]:
            transport.all_gather(output, input)
            return [output]

        return self._submit("all_gather_single", [output, input], job)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        for out, inp in zip(outputs, inputs, strict=True):
            self._check_multiple("all_gather_single_coalesced", out, inp, "output")

        def job(transport: Transport) -> list[torch.Tensor]:
            flat_in = _flat(inputs)
            flat_out = torch.empty(
                self._size * flat_in.numel(), dtype=flat_in.dtype, device=flat_in.device
            )
            transport.all_gather(flat_out, flat_in)
            by_rank = flat_out.view(self._size, -1).split([t.numel() for t in inputs], dim=1)
            for out, piece in zip(outputs, by_rank, strict=True):
                out.copy_(piece.reshape(out.shape))
            return outputs

        return self._submit("all_gather_single_coalesced", [*outputs, *inputs], job)

    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        root = (opts or dist.GatherOptions()).rootRank
        outputs = self._root_list("gather", root, inputs, output_lists, "input", "output")

        def job(transport: Transport) -> list[list[torch.Tensor]]:
            transport.gather(outputs, inputs[0], root)
            return output_lists

        return self._submit("gather", [*inputs, *(outputs or [])], job)

    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        root = (opts or dist.ScatterOptions()).rootRank
        inputs = self._root_list("scatter", root, outputs, input_lists, "output", "input")

        def job(transport: Transport) -> list[torch.Tensor]:
            transport.scatter(outputs[0], inputs, root)
            return outputs

        return self._submit("scatter", [*outputs, *(inputs or [])], job)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        out_splits = self._splits("output", output, output_split_sizes)
        in_splits = self._splits("input", input, input_split_sizes)
        if not output_split_sizes and not input_split_sizes:
            if output.shape[:1] != input.shape[:1]:
                raise ValueError(
                    "tpu_dist all_to_all_single: without split sizes input and output need the "
                    f"same rows, got {list(input.shape[:1])} and {list(output.shape[:1])}"
                )
            out_splits = in_splits = []  # equal chunks everywhere: the transport needs no splits
        if output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
            raise ValueError(
                "tpu_dist all_to_all_single: rows of input and output must match, got input "
                f"{input.dtype}{list(input.shape)} and output {output.dtype}{list(output.shape)}"
            )

        def job(transport: Transport) -> list[torch.Tensor]:
            transport.all_to_all(output, input, out_splits, in_splits)
            return [output]

        return self._submit("all_to_all_single", [output, input], job)

    def _splits(self, what: str, tensor: torch.Tensor, splits: Sequence[int]) -> list[int]:
        rows = tensor.shape[0] if tensor.dim() else 1
        if not splits:
            if rows % self._size:
                raise ValueError(
                    f"tpu_dist all_to_all_single: {what} has {rows} rows, not divisible by the "
                    f"group size {self._size}; pass {what}_split_sizes for uneven splits"
                )
            return [rows // self._size] * self._size
        splits = [int(s) for s in splits]
        if len(splits) != self._size or min(splits) < 0 or sum(splits) != rows:
            raise ValueError(
                f"tpu_dist all_to_all_single: {what}_split_sizes {splits} must be {self._size} "
                f"non-negative row counts summing to the {what}'s {rows} rows"
            )
        return splits

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        self._check_list("alltoall", "input list", inputs)
        self._check_list("alltoall", "output list", outputs)
        if len({t.dtype for t in [*inputs, *outputs]}) > 1:
            raise ValueError("tpu_dist alltoall: all input and output tensors must share a dtype")

        def job(transport: Transport) -> list[torch.Tensor]:
            flat_in = _flat(inputs)
            flat_out = torch.empty(
                sum(t.numel() for t in outputs), dtype=flat_in.dtype, device=flat_in.device
            )
            transport.all_to_all(
                flat_out, flat_in, [t.numel() for t in outputs], [t.numel() for t in inputs]
            )
            _copy_pieces(flat_out, outputs)
            return outputs

        return self._submit("alltoall", [*outputs, *inputs], job)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        self._check_rank("send", "destination", dst)
        return self._each("send", tensors, lambda transport, t: transport.send(t, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        self._check_rank("recv", "source", src)
        return self._each("recv", tensors, lambda transport, t: transport.recv(t, src, tag))

    def barrier(self, opts: Any = None) -> dist.Work:
        """On the host lane, once the device lane has run what was issued before it."""
        drained = self._device_worker.submit("barrier", list, str) if self._device_worker else None

        def job(transport: Transport) -> list[torch.Tensor]:
            if drained is not None:
                drained.wait()
            transport.barrier()
            return []

        return self._submit("barrier", [], job)

    # ---- lifetime ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Drain queued collectives, then close the transports."""
        for worker in (self._worker, self._device_worker):
            if worker is not None:
                worker.close()
        for transport in (self._transport, self._device_transport):
            if transport is not None:
                transport.shutdown()

    def abort(self) -> None:
        self.shutdown()

    # Pre-2.13 c10d names.
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single
