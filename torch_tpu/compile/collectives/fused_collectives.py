"""Opt-in: collectives lowered into the compiled program (``with torch_tpu.compile.fuse_collectives():``).

By default a graph with collectives is split at each one (:mod:`torch_tpu.compile.collectives.collectives`).
Graphs compiled inside :func:`fuse_collectives` become ONE program instead: a ``shard_map`` over
the group's devices (the global mesh of the multi-controller JAX runtime, one device per process,
in group-rank order), in which every segment runs on this rank's block and every collective is
the XLA collective over the mesh axis (``psum``, ``pmin``/``pmax``, ``all_gather``,
``psum_scatter``, ``all_to_all``), so XLA can schedule communication among the compute.

Needs the processes to run multi-controller JAX (tpu_dist's XLA transport) and one group for all
of the graph's collectives. A graph this mode cannot express (random ops or in-place input
updates, a reduce op XLA has no collective for, uneven ``all_to_all_single``, coalesced
collectives, CPU tensors) falls back to the split graph, with a warning naming the reason. The
mode is read when a graph is compiled (a function's first call, or a recompile): calls of a graph
compiled before keep their form. The same first-call check that ranks run the same collectives
applies.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.fx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torch_tpu.compile.collectives.collectives import (
    Segment,
    bind_collective,
    check_same_collectives,
    collective_sequence,
    process_group_of,
)
from torch_tpu.compile.program.fx_to_jax import is_collective, mutated_inputs, needs_random_key, to_jax_function
from torch_tpu.runtime._jax import jax
from torch_tpu.runtime.dtypes import to_jax_dtype
from torch_tpu.runtime.tensor import TpuTensor, from_jax, to_jax

AXIS = "ranks"
_log = logging.getLogger(__name__)
_state = threading.local()


@contextlib.contextmanager
def fuse_collectives(enabled: bool = True) -> Iterator[None]:
    """Graphs compiled inside lower their collectives into the program (see the module doc)."""
    before = getattr(_state, "on", False)
    _state.on = enabled
    try:
        yield
    finally:
        _state.on = before


def fusing() -> bool:
    return getattr(_state, "on", False)


class NotFusable(Exception):
    """This graph's collectives cannot be lowered into one program (the reason is the message)."""


def group_mesh(pg: dist.ProcessGroup) -> Mesh:
    ranks = dist.get_process_group_ranks(pg)
    if jax.process_count() != dist.get_world_size():
        raise NotFusable("the processes do not run multi-controller JAX (tpu_dist's XLA transport)")
    devices = []
    for r in ranks:
        own = [d for d in jax.devices() if d.process_index == r]
        if not own:
            raise NotFusable(f"JAX process {r} has no device")
        devices.append(min(own, key=lambda d: d.id))
    return Mesh(np.array(devices), (AXIS,))


_REDUCE_OPS = ("sum", "avg", "min", "max")


def _reduce(x: jax.Array, op: str, n: int) -> jax.Array:
    op = op.lower()
    if op in ("sum", "avg"):
        out = lax.psum(x, AXIS)
        if op == "avg":
            if not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
                raise NotFusable("avg of an integer tensor")
            out = (out / n).astype(x.dtype)
        return out
    if op == "min":
        return lax.pmin(x, AXIS)
    if op == "max":
        return lax.pmax(x, AXIS)
    raise NotFusable(f"reduce op {op!r} has no XLA collective")


def lower_collective(node: torch.fx.Node, n: int) -> Any:
    """``fn(input) -> output`` in the shard_map body for one collective node."""
    name = node.target._schema.name.split("::")[1]
    b = bind_collective(node.target, node.args, node.kwargs)
    if name == "wait_tensor":
        return lambda x: x
    if name == "all_reduce":
        op = b["reduce_op"]
        if op.lower() not in _REDUCE_OPS:
            raise NotFusable(f"reduce op {op!r} has no XLA collective")
        return lambda x: _reduce(x, op, n)
    if name == "all_gather_into_tensor":
        return lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True)
    if name == "reduce_scatter_tensor":
        op = b["reduce_op"].lower()
        if op not in ("sum", "avg"):
            raise NotFusable(f"reduce_scatter with {op!r}")

        def reduce_scatter(x: jax.Array) -> jax.Array:
            out = lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)
            return (out / n).astype(x.dtype) if op == "avg" else out

        return reduce_scatter
    if name == "all_to_all_single":
        splits = {int(s) for s in (*b["output_split_sizes"], *b["input_split_sizes"])}
        if len(splits) > 1:
            raise NotFusable("uneven all_to_all_single")
        return lambda x: lax.all_to_all(x, AXIS, 0, 0, tiled=True)
    if name == "broadcast":
        src = int(b["src"])
        return lambda x: lax.all_gather(x, AXIS)[src]
    raise NotFusable(f"{node.target} is not lowered into programs")


class FusedGraph:
    """A graph with collectives as one shard_map program over the group's devices (boxed call)."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str, steps: list[Segment | torch.fx.Node],
                 example_inputs: list[Any]) -> None:
        self.kind, self._gm, self._boxed_call = kind, gm, True
        self._placeholders = [p for p in gm.graph.nodes if p.op == "placeholder"]
        self._output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        if any(not isinstance(x, torch.Tensor) or x.device.type != "tpu" for x in example_inputs):
            raise NotFusable("graph inputs other than tpu tensors")
        groups = {bind_collective(n.target, n.args, n.kwargs).get("group_name") for n in steps
                  if isinstance(n, torch.fx.Node) and is_collective(n)} - {None}
        if len(groups) != 1:
            raise NotFusable(f"collectives over {len(groups)} groups")
        pg = process_group_of(next(iter(groups)))
        self._mesh = group_mesh(pg)
        n = self._mesh.size
        body_steps: list[tuple[Any, ...]] = []
        for step in steps:
            if isinstance(step, Segment):
                if mutated_inputs(step.gm) or needs_random_key(step.gm):
                    raise NotFusable("random ops or in-place input updates")
                body_steps.append(("segment", step, to_jax_function(step.gm)))
            elif not is_collective(step):
                raise NotFusable(f"{step.target} of a collective's result list")
            else:
                body_steps.append(("collective", step, lower_collective(step, n)))
        # the program returns the graph outputs it computes; inputs passed through stay on the host
        outs = self._output.args[0] if isinstance(self._output.args[0], (list, tuple)) else (self._output.args[0],)
        self._computed = [o for o in dict.fromkeys(outs)
                          if isinstance(o, torch.fx.Node) and o.op not in ("placeholder", "get_attr")]
        if any(o.op == "get_attr" for o in outs if isinstance(o, torch.fx.Node)):
            raise NotFusable("a graph constant as an output")
        placeholders, computed = self._placeholders, self._computed

        def body(*blocks: jax.Array) -> tuple:
            env: dict[torch.fx.Node, Any] = {p: b[0] for p, b in zip(placeholders, blocks)}
            for what, step, fn in body_steps:
                if what == "segment":
                    env.update(zip(step.outputs, fn(*[env[a] for a in step.inputs])))
                else:
                    env[step] = fn(env[step.args[0]])
            return tuple(env[o][None] for o in computed)

        spec = PartitionSpec(AXIS)
        self._sharding = NamedSharding(self._mesh, spec)
        self._local = next(d for d in self._mesh.devices.flat if d.process_index == jax.process_index())
        self._run = jax.jit(jax.shard_map(body, mesh=self._mesh, in_specs=spec, out_specs=spec))
        self._avals = [jax.ShapeDtypeStruct((n, *x.shape), to_jax_dtype(x.dtype), sharding=self._sharding)
                       for x in example_inputs]
        self.collectives = collective_sequence(gm)
        self.digest: str | None = None

    def stablehlo(self) -> str:
        """The program as StableHLO text (MLIR): the collectives are in it."""
        return self._run.lower(*self._avals).as_text()

    def _global(self, t: torch.Tensor) -> jax.Array:
        local = jax.device_put(to_jax(t)[None], self._local)
        return jax.make_array_from_single_device_arrays(
            (self._mesh.size, *local.shape[1:]), self._sharding, [local])

    def __call__(self, args: list[Any]) -> list[Any]:
        if any(type(a) is not TpuTensor for a in args):
            raise RuntimeError("torch_tpu.compile.fuse_collectives: a graph compiled for tpu inputs got others")
        env: dict[torch.fx.Node, Any] = dict(zip(self._placeholders, args))
        args.clear()
        if self.digest is None:
            self.digest = check_same_collectives(self._gm, self.kind)
        outs = self._run(*[self._global(env[p]) for p in self._placeholders])
        env.update((node, from_jax(o.addressable_data(0)[0])) for node, o in zip(self._computed, outs))
        out = torch.fx.node.map_arg(self._output.args[0], lambda n: env[n])
        return list(out) if isinstance(out, (list, tuple)) else [out]
