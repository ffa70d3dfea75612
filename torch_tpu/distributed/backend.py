"""Registration of the ``tpu_dist`` c10d backend, and the choice of each group's transport.

A group's tpu tensors travel through the XLA transport when the processes run multi-controller
JAX (the default group joins ``jax.distributed`` itself, through its store, if the JAX backend has
not started yet), else through the gloo transport. ``TPU_DIST_TRANSPORT=auto|xla|gloo`` or
``pg_options=TransportOptions(...)`` choose; "xla" fails with the reason when it cannot be had.
One XLA transport per set of ranks: XLA programs over the same devices must not interleave, and
groups run on their own threads, so a second live group over the same ranks uses gloo (even when
"xla" was asked for).

A group of several ranks has a device lane for its tpu tensors (the XLA transport, or a gloo one)
beside the host lane (a gloo transport) for cpu tensors; see
:class:`~torch_tpu.distributed.process_group.ProcessGroupTPU`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

import torch.distributed as dist

from torch_tpu.distributed.process_group import BACKEND_NAME, ProcessGroupTPU
from torch_tpu.distributed.transport import GlooTransport, Transport
from tpu_facts import knobs

TRANSPORT_ENV = knobs.DIST_TRANSPORT.name
TRANSPORTS = ("auto", "xla", "gloo")
_log = logging.getLogger("torch_tpu.distributed")


@dataclasses.dataclass(frozen=True)
class TransportOptions:
    """``pg_options`` for a ``tpu_dist`` group: ``transport`` is "auto", "xla" or "gloo"."""

    transport: str = "auto"

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"tpu_dist transport {self.transport!r} is not one of {', '.join(TRANSPORTS)}"
            )


def _requested(backend_options: Any) -> str:
    if isinstance(backend_options, TransportOptions):
        return backend_options.transport
    return TransportOptions(knobs.DIST_TRANSPORT.choice()).transport


# c10d names groups by a counter it resets when the default group is destroyed, and a launcher's
# store (torchrun's agent store) outlives the groups: a group made again under a name used before
# must not find the last one's gloo addresses in the store (a peer connecting to a closed port
# fails, "Connection refused", or waits out the timeout). The ranks of a group create it the same
# number of times, so a count of the creations in this process tells the rounds apart on all of them.
_creations: collections.Counter[tuple[str, tuple[int, ...]]] = collections.Counter()


def _round(opts: Any) -> str:
    """``<ranks>/<n>``: the group's ranks and how often this process created the group before."""
    ranks = tuple(opts.global_ranks_in_group) or tuple(range(opts.group_size))
    n = _creations[(opts.group_id, ranks)]
    _creations[(opts.group_id, ranks)] += 1
    return f"{','.join(map(str, ranks))}/{n}"


def _gloo(opts: Any, prefix: str) -> GlooTransport:
    return GlooTransport(opts.store, opts.group_rank, opts.group_size, opts.timeout, prefix)


def _xla_or_reason(opts: Any, gloo: GlooTransport) -> Transport | str:
    """An XLA transport for the group, or why it cannot have one."""
    from torch_tpu.distributed import xla_join, xla_transport

    default_group = not dist.is_initialized()
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    global_rank = opts.group_rank if default_group else dist.get_rank()
    if default_group and not xla_join.joined() and not xla_join.backend_started():
        xla_join.init_xla_transport(  # ranks start at different times: no short collective timeout
            opts.store, rank=opts.group_rank, world_size=opts.group_size,
            timeout=max(opts.timeout, xla_join.MIN_JOIN_TIMEOUT), collective_timeout=opts.timeout,
        )
    reason = xla_join.xla_unavailable_reason(global_rank, ranks)
    return reason or xla_transport.XlaTransport(gloo, ranks, opts.timeout)


def _ranks_taken(opts: Any) -> bool:
    if not dist.is_initialized():
        return False
    from torch_tpu.distributed import xla_transport

    return xla_transport.claimed(list(opts.global_ranks_in_group) or list(range(opts.group_size)))


def _create_process_group(opts: Any, backend_options: Any) -> ProcessGroupTPU:
    requested = _requested(backend_options)
    round_ = _round(opts)
    host = _gloo(opts, f"tpu_dist_gloo/{round_}")
    if opts.group_size == 1 and requested != "xla":  # nothing to move: no JAX coordinator
        _log.info("tpu_dist group %s: gloo transport, 1 rank", opts.group_id)
        return ProcessGroupTPU(host, opts.timeout, global_ranks=opts.global_ranks_in_group)
    device: Transport = _gloo(opts, f"tpu_dist_gloo_device/{round_}")
    if requested != "gloo" and _ranks_taken(opts):
        _log.info("tpu_dist group %s: gloo transport (another live group over its ranks has the "
                  "XLA transport)", opts.group_id)
        requested = "gloo"
    if requested != "gloo":
        chosen = _xla_or_reason(opts, device)
        if isinstance(chosen, str):
            if requested == "xla":
                raise RuntimeError(f"tpu_dist: the XLA transport was requested, but {chosen}")
            _log.info("tpu_dist group %s: gloo transport (%s)", opts.group_id, chosen)
        else:
            device = chosen
    _log.info("tpu_dist group %s: %s transport for tpu tensors, gloo for cpu tensors, rank %d of %d",
              opts.group_id, device.name, opts.group_rank, opts.group_size)
    return ProcessGroupTPU(host, opts.timeout, global_ranks=opts.global_ranks_in_group,
                           device_transport=device)


def active_transport(group: dist.ProcessGroup | None = None) -> str:
    """"xla" or "gloo": how tpu tensors travel on ``group`` (default: the world), a tpu_dist group."""
    pg = group or dist.group.WORLD
    if pg is None:
        raise RuntimeError("active_transport: torch.distributed is not initialized")
    if isinstance(pg, ProcessGroupTPU):  # c10d hands out the factory's ProcessGroup itself
        return pg.transport_name
    raise ValueError(f"active_transport: group {pg.group_name!r} is not a tpu_dist group")


def register_backend() -> None:
    """Make ``init_process_group("tpu_dist")`` available for tpu and cpu tensors."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_process_group, extended_api=True, devices=["tpu", "cpu"]
    )
