"""One program run by every rank of a process group, each on its own data: SPMD over the group.

The program is a JAX function of each rank's LOCAL arrays whose collectives are the XLA
collectives over the mesh axis (:data:`AXIS`): it runs as a ``shard_map`` over the group's
devices, one per process (multi-controller JAX: tpu_dist's XLA transport; ICI on a TPU slice,
gloo inside XLA:CPU here). A rank passes its local arrays and gets its local outputs back; each
local array of rank ``r`` is block ``r`` of a global array (dimension 0 stacked over the ranks; a
scalar becomes a block of one), built and taken apart without copies.

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

from torch_tpu.compile.fused_collectives import AXIS, _lower, _mesh
from torch_tpu.runtime._jax import jax


def collective_lowering(group: dist.ProcessGroup) -> Callable[[Any], Callable[[Any], Any]]:
    """``to_jax_function``'s ``collectives`` for a program run over ``group``'s ranks."""
    n = dist.get_world_size(group)
    return lambda node: _lower(node, n)


def describe_inputs(avals: Sequence[Any]) -> list[str]:
    """One line per program input (dtype and shape), for the ranks' agreement check."""
    return [f"{i}: {np.dtype(a.dtype).name}{list(a.shape)}" for i, a in enumerate(avals)]


class SpmdProgram:
    """``fn`` (of local arrays shaped as ``avals``) as one program over ``group``'s ranks, with
    inputs ``donated`` (positions) updated in place. :meth:`run` takes and returns local arrays."""

    def __init__(self, fn: Callable[..., tuple], group: dist.ProcessGroup, avals: Sequence[Any],
                 donated: Sequence[int]) -> None:
        self.mesh = _mesh(group)
        n = self.mesh.size
        self._local = next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())
        self._sharding = NamedSharding(self.mesh, PartitionSpec(AXIS))
        self._scalar_in = [len(a.shape) == 0 for a in avals]
        self._global_shapes = [(n,) if len(a.shape) == 0 else (n * a.shape[0], *a.shape[1:]) for a in avals]
        scalar_in = self._scalar_in
        self._scalar_out: list[bool] = []

        def body(*blocks: jax.Array) -> tuple:
            outs = fn(*[b.reshape(()) if s else b for b, s in zip(blocks, scalar_in)])
            self._scalar_out[:] = [o.ndim == 0 for o in outs]  # (known once traced)
            return tuple(o.reshape(1) if o.ndim == 0 else o for o in outs)

        spec = PartitionSpec(AXIS)
        spmd = jax.shard_map(body, mesh=self.mesh, in_specs=spec, out_specs=spec, check_vma=False)
        self.jitted = jax.jit(spmd, donate_argnums=tuple(donated))
        self._avals = [jax.ShapeDtypeStruct(shape, a.dtype, sharding=self._sharding)
                       for shape, a in zip(self._global_shapes, avals)]
        jax.eval_shape(spmd, *self._avals)  # traces the body: which outputs are scalars

    def _global(self, i: int, local: Any) -> jax.Array:
        if isinstance(local, np.ndarray) or local.devices() != {self._local}:
            local = jax.device_put(local, self._local)
        if self._scalar_in[i]:
            local = local.reshape(1)
        return jax.make_array_from_single_device_arrays(self._global_shapes[i], self._sharding, [local])

    def run(self, inputs: Sequence[Any]) -> list[jax.Array]:
        """This rank's outputs for its ``inputs`` (every rank calls it: the program's collectives)."""
        outs = self.jitted(*map(self._global, range(len(inputs)), inputs))
        return [o.addressable_data(0).reshape(()) if s else o.addressable_data(0)
                for o, s in zip(outs, self._scalar_out)]

    def lowered_text(self) -> str:
        """The program as StableHLO text (its collectives and the donated buffers' aliasing in it)."""
        return self.jitted.lower(*self._avals).as_text()
