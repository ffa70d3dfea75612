"""One program run by every rank of a process group, each on its own data: SPMD over the group.

The program is a JAX function of each rank's LOCAL arrays whose collectives are the XLA
collectives over the mesh axis (:data:`AXIS`): it runs as a ``shard_map`` over the group's
devices, one per process (multi-controller JAX: tpu_dist's XLA transport; ICI on a TPU slice,
gloo inside XLA:CPU here). A rank passes its local arrays and gets its local outputs back, with no
copies and no reshapes: each argument and result is declared replicated over the mesh, and each
process supplies (and reads back) its own device's buffer, so the body sees every rank's own
values. Replication is never checked or exploited (``check_vma=False``): JAX inserts no
collective of its own and the program's collectives are the ones the function calls.

Every rank must run the same program: the same function on inputs of the same shapes. The
caller checks that where a program is built (``check_same_collectives`` with the inputs'
description); a rank whose program differs fails there instead of hanging in a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch.distributed as dist
from jax.sharding import NamedSharding, PartitionSpec

import torch_tpu.compile.program.graph as compiled_graph
from torch_tpu.compile.collectives.fused_collectives import group_mesh, lower_collective
from torch_tpu.compile.program.executables import CompiledProgram
from torch_tpu.runtime._jax import jax


def collective_lowering(group: dist.ProcessGroup) -> Callable[[Any], Callable[[Any], Any]]:
    """``to_jax_function``'s ``collectives`` for a program run over ``group``'s ranks."""
    n = dist.get_world_size(group)
    return lambda node: lower_collective(node, n)


def describe_inputs(avals: Sequence[Any]) -> list[str]:
    """One line per program input (dtype and shape), for the ranks' agreement check."""
    return [f"{i}: {np.dtype(a.dtype).name}{list(a.shape)}" for i, a in enumerate(avals)]


class SpmdProgram:
    """``fn`` (of local arrays) as one program over ``group``'s ranks, with inputs ``donated``
    (positions) updated in place; or ``exported``, such a program as :meth:`export` gave it, whose
    executable (this rank's) is stored under the program's ``key``. A call takes and returns local
    arrays."""

    def __init__(self, fn: Callable[..., tuple] | None, group: dist.ProcessGroup, donated: Sequence[int],
                 exported: Any = None, key: str | None = None) -> None:
        self.mesh = group_mesh(group)
        self._local = next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())
        self._sharding = NamedSharding(self.mesh, PartitionSpec())
        if exported is not None:
            self._spmd = exported.call
        else:
            self._spmd = jax.shard_map(lambda *xs: tuple(fn(*xs)), mesh=self.mesh, in_specs=PartitionSpec(),
                                       out_specs=PartitionSpec(), check_vma=False)
        self._program = CompiledProgram(self._spmd, donated, key if exported is not None else None)

    def export(self, avals: Sequence[Any]) -> Any:
        """The program for local inputs shaped as ``avals``, as a ``jax.export`` over the group's
        devices (to store: :meth:`__init__` runs it again)."""
        return compiled_graph.export(self._spmd)(
            *(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._sharding) for a in avals))

    def _global(self, local: Any) -> jax.Array:
        if isinstance(local, np.ndarray) or local.devices() != {self._local}:
            local = jax.device_put(local, self._local)
        return jax.make_array_from_single_device_arrays(local.shape, self._sharding, [local])

    def __call__(self, *inputs: Any) -> list[jax.Array]:
        """This rank's outputs for its ``inputs`` (every rank calls it: the program's collectives)."""
        return [o.addressable_data(0) for o in self._program(*map(self._global, inputs))]

    def lowered_text(self, *inputs: Any) -> str:
        """The program for ``inputs`` as StableHLO text (its collectives and the donated buffers'
        aliasing in it)."""
        return self._program.lowered_text(*map(self._global, inputs))
