"""``torch.tpu.distributed``'s names under TorchTPU's signatures: ``topology_aware_mesh``,
``set_tpu_launch_env``, ``spmd_safe`` and the collective window settings.

* :func:`topology_aware_mesh`: TorchTPU's signature (the full logical shape; slices read off the
  devices) over :func:`torch_tpu.distributed.device_mesh.topology_aware_mesh`'s placement; also
  ``torch.tpu.topology_aware_mesh``, TorchTPU's deprecated alias.

* :func:`set_tpu_launch_env`: the environment a launcher (torchrun) needs, set once in the parent,
  never overwriting a variable already set: the ``spawn`` start method, ``NNODES``,
  ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``. Hosts come from ``TPU_WORKER_HOSTNAMES``
  (comma-separated, as on Cloud TPU VMs), this host's rank from ``JOB_COMPLETION_INDEX``; one
  host when neither is set. TorchTPU's slice-builder addresses have no counterpart here: tpu_dist
  connects through torch's store.
* :func:`spmd_safe`: marks a function that issues the same device work on every rank. Eager
  collectives here already run in program order with the ops around them (tpu_dist), so the
  wrapper calls the function unchanged; under ``torch.compile`` its graph nodes carry the
  ``spmd_safe`` annotation, as TorchTPU's do.
* ``window_num_stripes`` / ``window_stripe_chunk_mb``: how TorchTPU stripes large collective
  transfers over ICI links. Validated and kept (``torch.tpu.distributed.window_num_stripes = 4``);
  tpu_dist's transports (gloo, XLA collectives) do not stripe, so they change no transfer.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torch_tpu.distributed import device_mesh
from tpu_facts import Slice

_F = TypeVar("_F", bound=Callable[..., Any])
SPMD_SAFE_METADATA_KEY = "spmd_safe"
_window = {"window_num_stripes": 1, "window_stripe_chunk_mb": 4}


def _set_default(name: str, value: Callable[[], str]) -> str:
    if name not in os.environ:
        os.environ[name] = value()
    return os.environ[name]


def set_tpu_launch_env(*, nnodes: int | None = None, nproc_per_node: int | None = None) -> None:
    """Set the launch environment (module docstring); idempotent. ``nnodes`` is checked against
    ``TPU_WORKER_HOSTNAMES``; ``nproc_per_node`` must be positive (one process drives one device)."""
    if nproc_per_node is not None and nproc_per_node < 1:
        raise ValueError(f"set_tpu_launch_env(): nproc_per_node must be positive, got {nproc_per_node}")
    if multiprocessing.get_start_method(allow_none=True) is None:
        multiprocessing.set_start_method("spawn")
    hostnames_text = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    hosts = [h for h in hostnames_text.split(",") if h]
    if nnodes is not None and hosts and nnodes != len(hosts):
        raise ValueError(f"set_tpu_launch_env(): expected nnodes to match the number of hosts in environment variable "
                         f'TPU_WORKER_HOSTNAMES ({len(hosts)}: "{hostnames_text}"), got {nnodes}')
    completion_index = os.environ.get("JOB_COMPLETION_INDEX")
    nodes = nnodes if nnodes is not None else max(len(hosts), 1)
    if nodes > 1 and completion_index is None and "NODE_RANK" not in os.environ:
        raise ValueError("set_tpu_launch_env(): a multi-host job needs NODE_RANK or JOB_COMPLETION_INDEX set")
    if nodes > 1 and not hosts and "MASTER_ADDR" not in os.environ:
        raise ValueError("set_tpu_launch_env(): a multi-host job needs TPU_WORKER_HOSTNAMES or MASTER_ADDR set")
    _set_default("NNODES", lambda: str(nodes))
    _set_default("NODE_RANK", lambda: completion_index if completion_index is not None else "0")
    _set_default("MASTER_ADDR", lambda: hosts[0] if hosts else "127.0.0.1")
    _set_default("MASTER_PORT", lambda: "29500")


def spmd_safe(func: _F) -> _F:
    """Mark ``func`` as run identically on every rank (module docstring); same signature and result."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            with torch.fx.traceback.annotate({SPMD_SAFE_METADATA_KEY: True}):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def window_setting(name: str) -> int:
    return _window[name]


def set_window_setting(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"torch.tpu.distributed.{name} must be a positive int, got {value!r}")
    _window[name] = value


def topology_aware_mesh(mesh_shape: tuple[int, ...], *, dcn_mesh_shape: tuple[int, ...] | None = None,
                        allow_split_physical_axes: bool = False, contiguous_submeshes: bool = False) -> torch.Tensor:
    """TorchTPU's ``topology_aware_mesh``: an int64 tensor of global ranks of shape ``mesh_shape``
    (the full logical shape, ordered by increasing traffic; its product is the world size).
    ``dcn_mesh_shape`` splits axes over slices (same rank, dividing ``mesh_shape``; inferred when
    None from the slice count of ``Slice.from_env()``: the outermost axis it divides). Placement is
    :func:`torch_tpu.distributed.device_mesh.topology_aware_mesh`'s (whole physical axes for the
    inner dims), which never splits a physical axis: ``allow_split_physical_axes`` and
    ``contiguous_submeshes`` are accepted and change nothing. Without an initialized process group a
    one-process mesh is ``[0]``."""
    shape = tuple(int(d) for d in mesh_shape)
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"topology_aware_mesh: mesh_shape must be positive sizes, got {mesh_shape!r}")
    if not dist.is_initialized():
        if math.prod(shape) != 1:
            raise RuntimeError(f"topology_aware_mesh: mesh_shape {shape} spans {math.prod(shape)} devices; "
                               "initialize the process group over them first (torch.distributed.init_process_group)")
        return torch.zeros(shape, dtype=torch.int64)
    try:
        physical = Slice.from_env()
    except ValueError as error:  # off a TPU (plain torchrun): no slice to place ranks on
        return _ranks_in_order(shape, str(error))
    slices = physical.num_slices if dcn_mesh_shape is None else math.prod(dcn_mesh_shape)
    dcn = tuple(dcn_mesh_shape) if dcn_mesh_shape is not None else _infer_dcn(shape, slices)
    if len(dcn) != len(shape) or any(m % d for m, d in zip(shape, dcn)):
        raise ValueError(f"topology_aware_mesh: dcn_mesh_shape {dcn} must have mesh_shape {shape}'s rank and "
                         "divide it elementwise")
    if math.prod(dcn) == 1:
        return device_mesh.topology_aware_mesh("tpu", shape, slice_topology=physical)
    ici = tuple(m // d for m, d in zip(shape, dcn))
    return device_mesh.topology_aware_mesh("tpu", ici, topology="multi_slice", dcn_mesh_shape=dcn,
                                           slice_topology=physical)


def _ranks_in_order(shape: tuple[int, ...], why: str) -> torch.Tensor:
    """The mesh where no TPU slice is described: the world's ranks in order, as ``shape`` (said once)."""
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(f"topology_aware_mesh: mesh_shape {shape} holds {math.prod(shape)} devices, the process "
                         f"group {world}")
    _say_once(f"topology_aware_mesh: no TPU slice ({why}): the mesh is the {world} ranks in order")
    return torch.arange(world, dtype=torch.int64).reshape(shape)


@functools.cache
def _say_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _infer_dcn(shape: tuple[int, ...], slices: int) -> tuple[int, ...]:
    if slices == 1:
        return (1,) * len(shape)
    for axis, size in enumerate(shape):
        if size % slices == 0:
            return tuple(slices if i == axis else 1 for i in range(len(shape)))
    raise ValueError(f"topology_aware_mesh: no axis of mesh_shape {shape} divides over the {slices} slices; "
                     "give dcn_mesh_shape")
