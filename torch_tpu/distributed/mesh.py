"""``topology_aware_mesh``: lay parallelism dims onto the physical chips of a TPU slice.

A slice is a torus of chips (``TPU_TOPOLOGY=2x2x4``: x=2, y=2, z=4), each chip one or more
devices (tpu7x: 2). One process per device; device ranks follow the runtime's enumeration, core
fastest, then x, y, z::

    rank = slice * devices_per_slice + core + C * (x + X * (y + Y * z))

Mesh dims are given outer to inner, like ``init_device_mesh``. Inner dims communicate most (tensor
parallel), so they are placed first, each on whole physical axes where the sizes allow (an
all-reduce then runs on ICI rings), or on a contiguous block of one axis. With several slices
(``TPU_NUM_SLICES``), ``dcn_mesh_dims`` says which dims span slices (DCN, outer) -- by default the
first (data-parallel) dim -- as in JAX's hybrid device meshes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from tpu_facts import Slice

MeshDims = Mapping[str, int] | Sequence[tuple[str, int]]


def _slice_ranks(topology: Slice) -> np.ndarray:
    """Device ranks of slice 0 indexed by physical axes, slowest first (z, y, x, core)."""
    sizes = [size for _, size in reversed(topology.axes)]
    return np.arange(topology.devices_per_slice, dtype=np.int64).reshape(sizes)


@dataclass(frozen=True)
class MeshLayout:
    """A device mesh for ``init_device_mesh``-style use: shape, dim names and rank placement."""

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    ranks: np.ndarray = field(compare=False)
    physical_axes: dict[str, tuple[str, ...]]
    topology: Slice

    @property
    def is_identity(self) -> bool:
        """True when ranks are in row-major order, i.e. plain ``init_device_mesh`` would match."""
        return bool((self.ranks.reshape(-1) == np.arange(self.ranks.size)).all())

    def device_mesh(self, device_type: str = "tpu") -> torch.distributed.device_mesh.DeviceMesh:
        """The ``DeviceMesh`` over the default process group (which must span every device)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        world = dist.get_world_size()
        if world != self.ranks.size:
            raise ValueError(
                f"mesh {dict(zip(self.mesh_dim_names, self.mesh_shape))} needs {self.ranks.size} "
                f"ranks but the process group has {world}"
            )
        return DeviceMesh(
            device_type, torch.from_numpy(self.ranks.copy()), mesh_dim_names=self.mesh_dim_names
        )


def topology_aware_mesh(
    mesh_dims: MeshDims,
    *,
    dcn_mesh_dims: Mapping[str, int] | None = None,
    topology: Slice | None = None,
) -> MeshLayout:
    """Map ``mesh_dims`` (outer to inner; per-slice ICI sizes) onto ``topology``.

    ``dcn_mesh_dims`` multiplies named dims across slices; its product must be the slice count.
    ``topology`` defaults to :meth:`Slice.from_env`.
    """
    topology = topology or Slice.from_env()
    ici = _normalise(mesh_dims)
    dcn = _dcn_dims(ici, dcn_mesh_dims, topology.num_slices)
    wanted = math.prod(ici.values())
    if wanted != topology.devices_per_slice:
        raise ValueError(
            f"mesh dims {ici} hold {wanted} devices per slice, but a "
            f"{'x'.join(map(str, topology.shape))} {topology.chip.name} slice has "
            f"{topology.devices_per_slice} devices"
        )
    pieces = _assign_axes(ici, topology)
    slice_grid = _slice_grid(ici, pieces, topology)
    names = tuple(ici)
    ranks = _hybrid_grid(slice_grid, [dcn[n] for n in names], topology.devices_per_slice)
    physical = {
        n: (("dcn",) if dcn[n] > 1 else ()) + tuple(a for a, d, _ in pieces if d == n)
        for n in names
    }
    return MeshLayout(tuple(ranks.shape), names, ranks, physical, topology)


def _normalise(mesh_dims: MeshDims) -> dict[str, int]:
    items = list(mesh_dims.items() if isinstance(mesh_dims, Mapping) else mesh_dims)
    dims: dict[str, int] = {}
    for name, size in items:
        if name in dims:
            raise ValueError(f"mesh dim {name!r} is given twice")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh dim {name!r} must have a positive integer size, got {size!r}")
        dims[name] = size
    if not dims:
        raise ValueError("topology_aware_mesh needs at least one mesh dim")
    return dims


def _dcn_dims(ici: dict[str, int], dcn: Mapping[str, int] | None, slices: int) -> dict[str, int]:
    if dcn is None:
        dcn = {next(iter(ici)): slices}
    unknown = sorted(set(dcn) - set(ici))
    if unknown:
        raise ValueError(f"dcn_mesh_dims names {unknown}, which are not mesh dims {list(ici)}")
    if math.prod(dcn.values()) != slices:
        raise ValueError(
            f"dcn_mesh_dims {dict(dcn)} span {math.prod(dcn.values())} slices, but the topology "
            f"has {slices} (TPU_NUM_SLICES)"
        )
    return {n: dcn.get(n, 1) for n in ici}


def _assign_axes(
    ici: dict[str, int], topology: Slice
) -> list[tuple[str, str, int]]:
    """(physical axis, mesh dim, factor) pieces, inner mesh dims first, each axis inner-out."""
    remaining = dict(topology.axes)
    order = list(remaining)  # fastest first: preferred for the innermost mesh dims
    pieces: list[tuple[str, str, int]] = []
    for name, size in reversed(ici.items()):
        if size == 1:
            continue
        choice = _best_choice(size, remaining, order)
        if choice is None:
            free = {a: s for a, s in remaining.items() if s > 1}
            raise ValueError(
                f"cannot place mesh dim {name!r} of size {size} on the free physical axes {free} "
                f"of a {'x'.join(map(str, topology.shape))} {topology.chip.name} slice: its size "
                "must be a product of whole axes times a divisor of one more axis"
            )
        for axis, factor in choice:
            pieces.append((axis, name, factor))
            remaining[axis] //= factor
    return pieces


def _best_choice(
    size: int, remaining: dict[str, int], order: list[str]
) -> list[tuple[str, int]] | None:
    """Fewest axes first, whole axes before a split, fast axes before slow ones."""
    free = [a for a in order if remaining[a] > 1]
    for count in range(1, len(free) + 1):
        options = []
        for subset in itertools.combinations(free, count):
            for cut in subset:
                whole = math.prod(remaining[a] for a in subset if a != cut)
                if size % whole or remaining[cut] % (size // whole):
                    continue
                factor = size // whole
                key = (factor != remaining[cut], [order.index(a) for a in subset])
                options.append((key, [(a, factor if a == cut else remaining[a]) for a in subset]))
        if options:
            return min(options, key=lambda o: o[0])[1]
    return None


def _slice_grid(
    ici: dict[str, int], pieces: list[tuple[str, str, int]], topology: Slice
) -> np.ndarray:
    """Slice-0 ranks arranged as the ICI mesh (each physical axis cut into its pieces)."""
    grid = _slice_ranks(topology)
    labels: list[str] = []
    shape: list[int] = []
    for axis, _size in reversed(topology.axes):  # slowest first, as slice_ranks() is laid out
        mine = [(d, f) for a, d, f in pieces if a == axis]  # inner first
        for dim, factor in reversed(mine):
            labels.append(dim)
            shape.append(factor)
    if not labels:
        return grid.reshape(list(ici.values()))
    grid = grid.reshape(shape)
    names = list(ici)
    order = sorted(range(len(labels)), key=lambda i: (names.index(labels[i]), i))
    return grid.transpose(order).reshape(list(ici.values()))


def _hybrid_grid(slice_grid: np.ndarray, dcn: list[int], per_slice: int) -> np.ndarray:
    """Every slice's copy of ``slice_grid``, each mesh dim's slice index outermost within it."""
    slices = math.prod(dcn)
    offsets = (np.arange(slices, dtype=np.int64) * per_slice).reshape(dcn)
    full = offsets.reshape(dcn + [1] * len(dcn)) + slice_grid.reshape([1] * len(dcn) + list(slice_grid.shape))
    ndim = len(dcn)
    interleave = [i for d in range(ndim) for i in (d, ndim + d)]
    sizes = [dcn[d] * slice_grid.shape[d] for d in range(ndim)]
    return full.transpose(interleave).reshape(sizes)


# --- ranks placed by the coordinates they report ------------------------------------------------


class DeviceCoords(NamedTuple):
    """Where one rank's device sits: torus ``coords`` (x, y[, z]), the core on its chip, its slice."""

    coords: tuple[int, ...]
    core_on_chip: int = 0
    slice_index: int = 0


def device_index(device: DeviceCoords, topology: Slice) -> int:
    """The device's place in the enumeration order of the module docstring (the index
    :func:`topology_aware_mesh`'s layouts hold). Coordinates past the torus' dims must be 0 (JAX
    reports (x, y, 0) on 2-D tori)."""
    dims = len(topology.shape)
    coords = tuple(device.coords)
    if len(coords) < dims or any(coords[dims:]):
        raise ValueError(f"device {device} does not fit a {topology.shape_str} torus")
    place = {"core": device.core_on_chip, **dict(zip(("x", "y", "z"), coords))}
    axes = dict(topology.axes)
    if "core" not in axes and device.core_on_chip:
        raise ValueError(f"device {device}: a {topology.chip.name} chip has one device (core 0)")
    index = 0
    for axis, size in reversed(topology.axes):  # slowest first
        if not 0 <= place[axis] < size:
            raise ValueError(f"device {device} is outside the {topology.shape_str} {topology.chip.name} slice "
                             f"({axis} has {size})")
        index = index * size + place[axis]
    if not 0 <= device.slice_index < topology.num_slices:
        raise ValueError(f"device {device} is in slice {device.slice_index}, but there are {topology.num_slices}")
    return device.slice_index * topology.devices_per_slice + index


def enumerated_device(index: int, topology: Slice) -> DeviceCoords:
    """Inverse of :func:`device_index`: the device at ``index`` of the enumeration order."""
    slice_index, local = divmod(index, topology.devices_per_slice)
    place = {}
    for axis, size in topology.axes:  # fastest first
        local, place[axis] = divmod(local, size)
    coords = tuple(place[a] for a in ("x", "y", "z") if a in place)
    return DeviceCoords(coords, place.get("core", 0), slice_index)


def ranks_by_coordinates(
    mesh_shape: Sequence[int],
    devices: Sequence[DeviceCoords],
    topology: Slice,
    *,
    kind: str = "single_slice",
    dcn_mesh_shape: Sequence[int] | None = None,
) -> np.ndarray:
    """The rank layout of :func:`topology_aware_mesh` for ranks whose devices are ``devices`` (one
    per rank, in rank order), whatever order the launcher numbered them in.

    ``mesh_shape`` is per slice, outer to inner (innermost communicates most). ``kind``
    "single_slice" lays it on one slice; "multi_slice" multiplies each dim by ``dcn_mesh_shape``
    (slices, over DCN), giving a mesh of shape ``dcn_mesh_shape * mesh_shape`` elementwise."""
    shape = tuple(int(n) for n in mesh_shape)
    names = [f"dim{i}" for i in range(len(shape))]
    if kind == "single_slice":
        if dcn_mesh_shape is not None or topology.num_slices != 1:
            raise ValueError("topology='single_slice' takes no dcn_mesh_shape and one slice; use 'multi_slice'")
        dcn = None
    elif kind == "multi_slice":
        if dcn_mesh_shape is None or len(dcn_mesh_shape) != len(shape):
            raise ValueError(f"topology='multi_slice' needs a dcn_mesh_shape of {len(shape)} dims, "
                             f"got {dcn_mesh_shape}")
        dcn = dict(zip(names, (int(n) for n in dcn_mesh_shape)))
    else:
        raise ValueError(f"unknown topology {kind!r}: expected 'single_slice' or 'multi_slice'")
    if len(devices) != topology.num_devices:
        raise ValueError(f"{len(devices)} ranks reported devices, but the {topology.name} topology has "
                         f"{topology.num_devices}")
    layout = topology_aware_mesh(list(zip(names, shape)), dcn_mesh_dims=dcn, topology=topology)
    indices = np.array([device_index(d, topology) for d in devices], dtype=np.int64)
    first: dict[int, int] = {}
    for rank, index in enumerate(indices.tolist()):
        other = first.setdefault(index, rank)
        if other != rank:
            raise ValueError(f"ranks {other} and {rank} report the same device {devices[rank]}: "
                             "one process per device")
    rank_of_device = np.empty(len(indices), dtype=np.int64)
    rank_of_device[indices] = np.arange(len(indices), dtype=np.int64)
    return rank_of_device[layout.ranks]
