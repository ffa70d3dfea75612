"""Joining multi-controller JAX (``jax.distributed``) so ``tpu_dist`` can run XLA collectives.

Every process of a job must call ``jax.distributed.initialize`` (coordinator address, process
count, process id) before the JAX backend starts; afterwards ``jax.devices()`` lists every
process's devices and one jitted program over a global mesh moves data between processes (ICI on
a TPU slice, JAX's gloo CPU collectives on XLA:CPU). Process ids are torch's global ranks.

``tpu_dist`` joins by itself when its default group is created, the coordinator's address
travelling through the group's store. A process that uses the device before
``init_process_group`` calls :func:`init_xla_transport` first (from torchrun's environment, or with
a store). :func:`xla_unavailable_reason` says why a group cannot use the XLA transport.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist
from jax._src import xla_bridge

from torch_tpu.runtime._jax import jax
from tpu_facts import knobs

COORDINATOR_KEY = "tpu_dist_xla_coordinator"
MIN_JOIN_TIMEOUT = datetime.timedelta(seconds=60)
MIN_HEARTBEAT_TIMEOUT_S = 100  # JAX's default


def heartbeat_timeout_s(collective_timeout: datetime.timedelta) -> int:
    """How long JAX's coordination service may miss a process's heartbeat before it aborts every
    process: twice the collective timeout and a minute, so a stalled peer is first reported by
    tpu_dist (and the caller's own timeout handling) with a line of its own, not a SIGABRT."""
    return max(MIN_HEARTBEAT_TIMEOUT_S, int(2 * collective_timeout.total_seconds()) + 60)


def joined() -> bool:
    """Whether this process runs multi-controller JAX."""
    return jax.distributed.is_initialized()


def backend_started() -> bool:
    """Whether the JAX backend has started (too late to join)."""
    return xla_bridge.backends_are_initialized()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _coordinator_host() -> str:
    return knobs.DIST_COORDINATOR_HOST.text() or os.environ.get("MASTER_ADDR") or "127.0.0.1"


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(
            f"init_xla_transport: {name} is not set; pass rank/world_size/coordinator_address or "
            "launch with torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
        )
    return int(value)


def init_xla_transport(
    store: dist.Store | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    coordinator_address: str | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=5),
    collective_timeout: datetime.timedelta = dist.default_pg_timeout,
) -> None:
    """Join this process to multi-controller JAX as process ``rank`` of ``world_size``.

    Call it in every process before the first tpu tensor or JAX call. Without arguments it reads
    torchrun's RANK / WORLD_SIZE and puts the coordinator at MASTER_ADDR:MASTER_PORT+1 (offset from
    ``TPU_DIST_XLA_PORT_OFFSET``); with ``store`` rank 0 picks a free port and publishes it there.
    A second call with the same rank and size does nothing. ``collective_timeout``: the longest
    timeout of the process groups to come; JAX's heartbeat timeout outlasts it (:func:`heartbeat_timeout_s`).
    """
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"init_xla_transport: rank {rank} is not in [0, world_size={world_size})")
    if jax.distributed.is_initialized():
        joined = (jax.process_index(), jax.process_count())
        if joined != (rank, world_size):
            raise RuntimeError(
                f"init_xla_transport: already joined as process {joined[0]} of {joined[1]}, "
                f"asked for {rank} of {world_size}"
            )
        return
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "init_xla_transport: the JAX backend has already started in this process (a tpu "
            "tensor or JAX call came first); call it before the first device use"
        )
    if coordinator_address is None:
        coordinator_address = _rendezvous(store, rank, timeout)
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service catches SIGTERM in C++ (only noting it for sync points this project
    # never uses): a joined process would then outlive torchrun's stop signal and PR_SET_PDEATHSIG.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(
        coordinator_address,
        num_processes=world_size,
        process_id=rank,
        initialization_timeout=max(1, int(timeout.total_seconds())),
        heartbeat_timeout_seconds=heartbeat_timeout_s(collective_timeout),
    )


def _rendezvous(store: dist.Store | None, rank: int, timeout: datetime.timedelta) -> str:
    if store is None:
        offset = knobs.DIST_PORT_OFFSET.integer()
        port = _env_int("MASTER_PORT") + offset
        if port > 65535:
            raise ValueError(f"init_xla_transport: MASTER_PORT plus {knobs.DIST_PORT_OFFSET.name}={offset} is port "
                             f"{port}, above 65535")
        return f"{_coordinator_host()}:{port}"
    if rank == 0:
        store.set(COORDINATOR_KEY, f"{_coordinator_host()}:{_free_port()}")
    store.wait([COORDINATOR_KEY], timeout)
    return store.get(COORDINATOR_KEY).decode()


def xla_unavailable_reason(global_rank: int, global_ranks: list[int]) -> str | None:
    """Why a group of ``global_ranks`` (this process is ``global_rank``) cannot use XLA, or None."""
    if not jax.distributed.is_initialized():
        if xla_bridge.backends_are_initialized():
            return (
                "the JAX backend started before tpu_dist could join jax.distributed (a tpu tensor "
                "or JAX call came before init_process_group); call "
                "torch_tpu.distributed.init_xla_transport() before the first device use"
            )
        return "this process has not joined jax.distributed (see init_xla_transport)"
    if jax.process_index() != global_rank or max(global_ranks) >= jax.process_count():
        return (
            f"jax.distributed has process {jax.process_index()} of {jax.process_count()}, but "
            f"torch has global rank {global_rank} and group ranks {global_ranks}"
        )
    platform = jax.local_devices()[0].platform
    if platform == "cpu" and jax.config.jax_cpu_collectives_implementation is None:
        return "XLA:CPU has no cross-process collectives (jax_cpu_collectives_implementation unset)"
    return None
