"""The one ``tpu_dist`` process group training runs over, from torchrun's environment (a plain run
is a private gloo world of 1: nothing travels, and it does not import :mod:`torch_tpu`).

Every collective of a run goes through it: the sparse engines' id and embedding all_to_alls,
DDP / FSDP2 of the dense towers, checkpoint (DCP) and agreement collectives. Host tensors travel
through its gloo transport; tpu tensors (``--dense-device tpu``) through its XLA transport where
the JAX backend has cross-process collectives (see :mod:`torch_tpu.distributed`), on a lane of
their own. A run without tpu tensors asks for the gloo transport (``TPU_DIST_TRANSPORT``
overrides): it has nothing for XLA to carry, and joining ``jax.distributed`` would tie every
rank's life to JAX's coordination service.

Every group gets the collective timeout (``--collective-timeout``, default 300 s): a collective
that a stalled rank never joins fails on the others after that long instead of hanging (the
group's timeout; :func:`new_group` passes it on, as ``dist.new_group`` does not inherit it).
A rank under torchrun also dies with its launcher (``PR_SET_PDEATHSIG``), leaving no orphans.
With several ranks a :mod:`~torchrec_tpu.rank_watch` heartbeat runs, so a failed collective
names the rank that stalled or failed (a failing rank posts its error before leaving).

Several ranks on one host are each bound to their own block of its CPUs before any thread pool
is sized (torch's, XLA:CPU's, which takes every CPU the process may use): unbound, each rank's
pools span every core and the ranks' spinning threads compete (measured on 2 cores, 2 ranks:
binding made both engines 30-50% faster).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch.distributed as dist

from torchrec_tpu import rank_watch
from torchrec_tpu.errors import one_line
from torchrec_tpu.launcher import die_with_parent
from tpu_facts import knobs, local_batch_of

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the training world."""

    rank: int
    world_size: int
    local_world_size: int
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    transport: str = "gloo"  # how tpu tensors travel on the group ("xla" or "gloo")

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.collective_timeout_s)

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    def local_batch_of(self, global_batch: int) -> int:
        """Each rank's share of a global batch (:func:`tpu_facts.local_batch_of`)."""
        return local_batch_of(global_batch, self.world_size)


def current_env(collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> DistEnv:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    transport = "gloo"
    if dist.get_backend() == "tpu_dist":
        import torch_tpu.distributed as tpu_dist

        transport = tpu_dist.active_transport()
    return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_world_size=local,
                   collective_timeout_s=collective_timeout_s, transport=transport)


def describe_transport(env: DistEnv) -> str:
    """One line for the job log: the group and how tensors travel on it."""
    return (f"collectives over one tpu_dist group of {env.world_size} ranks: tpu tensors by the "
            f"{env.transport} transport, host tensors by gloo")


def new_group(env: DistEnv) -> dist.ProcessGroup:
    """A second group over all ranks with ``env``'s collective timeout, for host-tensor
    collectives another thread issues (a collective). On tpu_dist it asks for the gloo transport
    (the default group holds the XLA one)."""
    if dist.get_backend() != "tpu_dist":
        return dist.new_group(timeout=env.timeout)
    import torch_tpu.distributed as tpu_dist

    return dist.new_group(timeout=env.timeout, pg_options=tpu_dist.TransportOptions("gloo"))


def threads_for_this_rank(requested: int) -> int:
    """CPU threads for this process's torch pools: ``requested`` (0: one per CPU), never more than
    the CPUs the process may run on (its block once bound): threads beyond the cores spin against
    each other (2 ranks x 2 threads on 2 cores collapsed both engines ~16x at the anchor config)."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return available if requested <= 0 else min(requested, available)


def bind_to_local_cpus(local_rank: int, local_world_size: int) -> set[int] | None:
    """Bind this process to block ``local_rank`` of ``local_world_size`` equal contiguous blocks of
    the CPUs it may run on; the block, or None (one rank, fewer CPUs than ranks, or no affinity
    support) when it stays as it is."""
    if local_world_size < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = len(cpus) // local_world_size
    if per_rank < 1 or not 0 <= local_rank < local_world_size:
        return None
    block = set(cpus[local_rank * per_rank:(local_rank + 1) * per_rank])
    os.sched_setaffinity(0, block)
    return block


# Called with the rendezvous store, the rank and the world size on every rank of a world of
# several, before the group forms (no collective has run).
Agreement = Callable[[dist.Store, int, int], None]


@contextlib.contextmanager
def process_group(collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
                  device_tensors: bool = False, bind_cpus: bool = False,
                  agree: Agreement | None = None) -> Iterator[DistEnv]:
    """Join the default ``tpu_dist`` process group for the duration of a run.

    Reuses one that already exists (the caller owns it), joins torchrun's world when its
    environment variables are set, and otherwise makes a world of 1 over an in-memory store, so a
    plain run needs no port. ``device_tensors``: the run has tpu tensors to move (the XLA
    transport is wanted; call this before the first device use so the group can join JAX).
    ``bind_cpus``: under torchrun, bind this rank to its block of the host's CPUs
    (:func:`bind_to_local_cpus`; call this before the first thread pool starts). ``agree``: the
    ranks' check that they run the same thing, before the transports they chose meet.
    """
    if dist.is_initialized():
        if agree is not None and dist.get_world_size() > 1:
            agree(dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size())
        yield current_env(collective_timeout_s)
        return
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    if all(v in os.environ for v in _TORCHRUN_VARS):
        import torch_tpu.distributed as tpu_dist

        die_with_parent()
        if bind_cpus and "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
            bind_to_local_cpus(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
        if agree is not None and world_size > 1:
            agree(store, rank, world_size)
        transport = knobs.DIST_TRANSPORT.value() or ("auto" if device_tensors else "gloo")
        # the prefix init_process_group gives a store it makes itself
        dist.init_process_group(tpu_dist.BACKEND_NAME, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world_size, timeout=timeout, pg_options=tpu_dist.TransportOptions(transport))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    env = current_env(collective_timeout_s)
    try:
        if env.world_size == 1:
            yield env
            return
        with rank_watch.watching(dist.distributed_c10d._get_default_store(), env.rank, env.world_size,
                                 collective_timeout_s) as watch:
            try:
                yield env
            except BaseException as error:
                watch.post_failure(one_line(error))
                raise
    finally:
        dist.destroy_process_group()
