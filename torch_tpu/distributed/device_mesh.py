"""Topology-aware meshes: a rank tensor for ``DeviceMesh`` (``torch.tpu.distributed.topology_aware_mesh``).

Launchers number ranks without looking at the chips (torchrun, a job scheduler), so rank order
need not follow the runtime's device enumeration. Here every rank reports where its device sits
(``torch.tpu.get_local_device_attributes()``: torus coordinates, core, slice), the reports are
all-gathered over the process group, and the layout of :func:`torch_tpu.distributed.mesh.topology_aware_mesh`
(the same placement: inner dims on whole physical axes, slices outermost) is translated from
devices to the ranks that drive them::

    import torch, torch_tpu
    from torch_tpu.distributed import device_mesh
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("tpu_dist")
    ranks = device_mesh.topology_aware_mesh("tpu", (4, 4))  # dp=4, tp=4
    mesh = DeviceMesh("tpu", mesh=ranks, mesh_dim_names=("dp", "tp"))

Every rank gets the same tensor (all derive it from the same gathered reports). Where the runtime
reports no coordinates (XLA:CPU) and no ``TORCH_TPU_DEVICE_COORDS`` override is set, rank order
is taken as device enumeration order. TorchTPU's own signature (``torch.tpu.distributed.topology_aware_mesh``)
is ``torch_tpu._internal.tpu_distributed``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from torch_tpu.distributed.mesh import DeviceCoords, enumerated_device, ranks_by_coordinates
from torch_tpu.runtime.device import get_local_device_attributes
from tpu_facts import Slice

__all__ = ["gather_device_coords", "topology_aware_mesh"]

_NO_COORDS = -1


def gather_device_coords(group: dist.ProcessGroup | None = None) -> list[DeviceCoords | None]:
    """Every rank's reported device (None for a rank that reports no coordinates), in rank order."""
    attrs = get_local_device_attributes()
    coords = tuple(attrs.get("coords", ()))
    if len(coords) > 3:
        raise ValueError(f"device coordinates {coords} have more than 3 dims")
    payload = torch.tensor(
        [len(coords) if "coords" in attrs else _NO_COORDS, *coords, *[0] * (3 - len(coords)),
         attrs.get("core_on_chip", 0), attrs.get("slice_index", 0)],
        dtype=torch.int64,
    )
    gathered = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, payload, group=group)
    devices: list[DeviceCoords | None] = []
    for t in gathered:
        n, x, y, z, core, slice_index = t.tolist()
        devices.append(None if n == _NO_COORDS else DeviceCoords((x, y, z)[:n], core, slice_index))
    return devices


def topology_aware_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    topology: str = "single_slice",
    dcn_mesh_shape: Sequence[int] | None = None,
    slice_topology: Slice | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """An int64 CPU tensor of global ranks, of shape ``mesh_shape`` ("single_slice") or
    ``dcn_mesh_shape * mesh_shape`` elementwise ("multi_slice": slices over DCN), to pass as
    ``DeviceMesh(device_type, mesh=...)``.

    ``mesh_shape`` is ordered by increasing traffic (data parallel outermost, the innermost dim on
    the fastest links), as in TorchTPU and JAX. Placement is computed from the devices every rank
    reports (all-gathered over ``group``, default: the world), not from rank order.
    ``slice_topology`` is the physical slice (default ``Slice.from_env()``: ``TPU_TOPOLOGY``,
    ``TPU_ACCELERATOR_TYPE``, ``TPU_NUM_SLICES``). ``device_type`` is the mesh's device type;
    the layout is the same for every type (it places the processes, whichever tensors they use).
    Needs an initialized process group spanning every device.
    """
    if not dist.is_initialized():
        raise RuntimeError("topology_aware_mesh needs an initialized process group "
                           "(torch.distributed.init_process_group)")
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a device type name such as 'tpu', got {device_type!r}")
    slice_topology = slice_topology or Slice.from_env()
    reported = gather_device_coords(group)
    missing = [rank for rank, d in enumerate(reported) if d is None]
    if missing and len(missing) != len(reported):
        raise RuntimeError(f"ranks {missing} report no device coordinates but the others do; set "
                           "TORCH_TPU_DEVICE_COORDS on every rank or on none")
    devices = [d if d is not None else enumerated_device(rank, slice_topology) for rank, d in enumerate(reported)]
    ranks = ranks_by_coordinates(mesh_shape, devices, slice_topology, kind=topology, dcn_mesh_shape=dcn_mesh_shape)
    return torch.from_numpy(ranks)
