"""TPU slices: names, shapes, devices and the interconnect model the planner costs against.

Naming conventions (Cloud TPU accelerator types; see ``tpu_facts.chips`` for sources):

* ``v5p-N`` and ``tpu7x-N`` count **TensorCores**, two per chip: v5p-64 = 32 chips (2x4x4),
  tpu7x-64 = 32 chips. A v5p chip is one JAX device (megacore) with 4 SparseCores; a tpu7x chip
  is two JAX devices (one per chiplet) with 2 SparseCores each, so tpu7x-64 = 64 devices.
* ``v6e-N`` counts **chips** (one TensorCore each): v6e-64 = 64 chips (8x8), one device per chip.
* A shape can be given instead of a count: ``v5p-4x4x4`` (64 chips), ``v6e-8x16`` (128 chips).
* Multislice: ``num_slices`` identical slices joined by DCN (``v5p-64`` with ``num_slices=2``).

Interconnect model (used by ``all_to_all_seconds``): a uniform all-to-all on a slice of shape
(n_1, .., n_k) sends each byte over ``H = sum_i h(n_i)`` ICI hops on average, where ``h(n) =
floor(n^2/4)/n`` on a ring (wraparound) and ``(n^2-1)/(3n)`` on a line. Every chip injects into
``2k`` links; a hop costs one link, so per-chip all-to-all time is ``bytes_per_chip * H / ici_bw``
(``ici_bw``: one direction, all links). Wraparound exists on dims of slices that are whole cubes
(v5p/tpu7x: multiples of 4x4x4 via the optical switches) or the full v6e pod (16x16); smaller
slices are meshes (Cloud TPU docs, "3D torus *" footnote). With S > 1 slices, a fraction
``(S-1)/S`` of the bytes also crosses DCN at ``dcn_bw`` per chip. Traffic into or out of one
device (a table-wise owner) is limited by that device's share of its chip's links:
``bytes * devices_per_chip / ici_bw``. Each collective pays ``collective_latency_s`` once.

Dense all-reduce (the data-parallel gradients, ``allreduce_seconds``), hierarchical over S slices
of C chips each (a chip's devices reduce among themselves first, over the die-to-die link):

1. reduce-scatter within each slice over ICI: ``(C-1)/C`` bytes per byte of gradient leave each
   chip; every chip then holds the slice's sum of one 1/C shard;
2. all-reduce of that shard across the slices over DCN, between the chips at the same position of
   each slice, all C pairs at once: ``2 (S-1)/S * 1/C`` bytes per byte at ``dcn_bw``;
3. all-gather within each slice over ICI: ``(C-1)/C`` bytes per byte again.

Time per byte ``2 (C-1)/C / ici_bw + 2 (S-1)/(S C) / dcn_bw``, and ``collective_latency_s`` per
phase (3 with several slices of several chips, else 1). A flat ring over all S*C chips would push
``2 (SC-1)/(SC)`` bytes per byte through every chip and cross DCN with nearly all of them; the
hierarchy cuts the DCN bytes C-fold, which is what makes multislice data parallelism affordable
(DCN is 10-100x slower than ICI per chip).

Constants that are not published (SparseCore share of HBM bandwidth, per-kernel overhead,
collective latency, HBM reserved for the dense model and XLA) live in ``CostConstants`` with
documented defaults; override them in a topology file.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from torchrec_tpu.file_numbers import file_number
from torchrec_tpu.structured_files import brief, read_structured
from tpu_facts import CHIP_GENERATIONS, GIB, ChipGeneration, chip_generation
from tpu_facts.slices import Slice, check_mod_sharding

# Documented slice shapes per chip count (v5p / v6e pages; tpu7x follows v5p's cube layout).
_CUBE_SHAPES = {
    4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
    256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16),
    6144: (16, 16, 24), 8192: (16, 16, 32),
}
_V6E_SHAPES = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
               256: (16, 16)}


@dataclass(frozen=True)
class CostConstants:
    """Planner constants that Google does not publish; defaults are engineering assumptions.

    * ``sparsecore_hbm_efficiency``: fraction of a device's HBM bandwidth its SparseCores reach on
      random row gathers/scatters (0.5: row-granular access, 8-float rows are 32 B bursts).
    * ``kernel_overhead_s``: fixed cost per stacked table per step on a device (launch and
      CSR bookkeeping), which is what makes stacking pay.
    * ``collective_latency_s``: fixed cost per collective (an all-to-all, a phase of the dense
      all-reduce).
    * ``hbm_reserved_fraction``: HBM kept free for the dense model, XLA buffers and fragmentation.
    * ``skew``: ratio of the hottest partition's ids to the mean (1.0 = uniform ids); scales the
      id-limit check.
    """

    sparsecore_hbm_efficiency: float = 0.5
    kernel_overhead_s: float = 5e-6
    collective_latency_s: float = 10e-6
    hbm_reserved_fraction: float = 0.1
    skew: float = 1.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not math.isfinite(value):
                raise ValueError(f"cost constant {name} must be a finite number, got {value}")
        for name in ("sparsecore_hbm_efficiency", "hbm_reserved_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0 or (name == "sparsecore_hbm_efficiency" and value == 0.0):
                raise ValueError(f"cost constant {name} must be in (0, 1], got {value}")
        for name in ("kernel_overhead_s", "collective_latency_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost constant {name} must be >= 0, got {getattr(self, name)}")
        if self.skew < 1.0:
            raise ValueError(f"cost constant skew must be >= 1.0, got {self.skew}")


@dataclass(frozen=True)
class TPUTopology(Slice):
    """A :class:`~tpu_facts.Slice` plus the planner constants it is costed with."""

    costs: CostConstants = field(default_factory=CostConstants)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_sparsecores:  # none (v5e, v4): the planner refuses it with its own line
            check_mod_sharding(self.num_sparsecores, f"{self.name} ({self.num_devices} devices x "
                                                     f"{self.sparsecores_per_device} SparseCores)")

    @property
    def usable_hbm_bytes_per_device(self) -> int:
        return int(self.hbm_bytes_per_device * (1.0 - self.costs.hbm_reserved_fraction))

    @property
    def sparsecore_bandwidth_per_device(self) -> float:
        """Bytes/s one device's SparseCores move to and from HBM on row gathers."""
        share = self.chip.hbm_bandwidth_bytes_per_s / self.chip.devices_per_chip
        return share * self.costs.sparsecore_hbm_efficiency

    @property
    def wraparound(self) -> tuple[bool, ...]:
        if self.chip.torus_dims == 2:
            full = self.chips_per_slice == self.chip.chips_per_pod
            return tuple(full for _ in self.shape)
        cubes = all(n % 4 == 0 for n in self.shape)
        return tuple(cubes for _ in self.shape)

    @property
    def mean_ici_hops(self) -> float:
        """Average ICI hops of a uniform all-to-all within one slice (see module docstring)."""
        total = 0.0
        for n, ring in zip(self.shape, self.wraparound):
            total += (n * n // 4) / n if ring else (n * n - 1) / (3 * n)
        return total

    def all_to_all_seconds(self, bytes_per_device: float) -> float:
        """Time for every device to send ``bytes_per_device`` spread uniformly over all devices
        (bandwidth term only; ``costs.collective_latency_s`` is charged per collective)."""
        if bytes_per_device <= 0 or self.num_devices == 1:
            return 0.0
        return bytes_per_device * self.uniform_seconds_per_byte

    @property
    def uniform_seconds_per_byte(self) -> float:
        """Seconds per byte a device sends in a uniform all-to-all (hop-weighted ICI + DCN share)."""
        per_chip = self.chip.devices_per_chip
        seconds = per_chip * self.mean_ici_hops / self.chip.ici_bandwidth_bytes_per_s
        return seconds + self._dcn_seconds_per_byte

    @property
    def hotspot_seconds_per_byte(self) -> float:
        """Seconds per byte into or out of ONE device (traffic limited by that chip's own links)."""
        return self.chip.devices_per_chip / self.chip.ici_bandwidth_bytes_per_s + self._dcn_seconds_per_byte

    @property
    def allreduce_ici_seconds_per_byte(self) -> float:
        """ICI seconds per byte of gradient of the hierarchical all-reduce: the reduce-scatter and
        the all-gather within each slice, ``2 (C-1)/C / ici_bw`` (module docstring)."""
        c = self.chips_per_slice
        return 2.0 * (c - 1) / c / self.chip.ici_bandwidth_bytes_per_s

    @property
    def allreduce_dcn_seconds_per_byte(self) -> float:
        """DCN seconds per byte of gradient of the hierarchical all-reduce: each chip's 1/C shard
        all-reduced across the S slices, ``2 (S-1)/(S C) / dcn_bw`` (0 on one slice)."""
        s = self.num_slices
        if s == 1:
            return 0.0
        return 2.0 * (s - 1) / s / self.chips_per_slice / self.chip.dcn_bandwidth_bytes_per_s

    @property
    def allreduce_seconds_per_byte(self) -> float:
        """Seconds per byte of gradient of the hierarchical all-reduce (bandwidth terms only)."""
        return self.allreduce_ici_seconds_per_byte + self.allreduce_dcn_seconds_per_byte

    @property
    def allreduce_phases(self) -> int:
        """Collectives of one hierarchical all-reduce: reduce-scatter (ICI), all-reduce (DCN),
        all-gather (ICI), less those over a single chip or slice."""
        ici, dcn = self.chips_per_slice > 1, self.num_slices > 1
        return 2 * ici + dcn if ici and dcn else int(ici or dcn)

    def allreduce_seconds(self, num_bytes: float) -> float:
        """Seconds to all-reduce ``num_bytes`` of gradient on every chip, hierarchically (module
        docstring), ``costs.collective_latency_s`` per phase included; 0 on one chip."""
        if num_bytes <= 0:
            return 0.0
        return num_bytes * self.allreduce_seconds_per_byte + self.allreduce_phases * self.costs.collective_latency_s

    @property
    def _dcn_seconds_per_byte(self) -> float:
        if self.num_slices == 1:
            return 0.0
        cross = self.chip.devices_per_chip * (self.num_slices - 1) / self.num_slices
        return cross / self.chip.dcn_bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        """The topology as plain data (what a plan records and a topology file can reload)."""
        return {**super().to_dict(), "costs": asdict(self.costs)}


def default_shape(chip: ChipGeneration, chips: int) -> tuple[int, ...]:
    """The documented slice shape for ``chips`` chips of ``chip`` (ValueError if none)."""
    table = _V6E_SHAPES if chip.torus_dims == 2 else _CUBE_SHAPES
    if chips not in table:
        sizes = ", ".join(str(chip.name_count_from_chips(c)) for c in sorted(table))
        raise ValueError(
            f"no standard {chip.name} slice with {chips} chips; standard sizes ({chip.name}-N): "
            f"{sizes}; or name a shape, e.g. {chip.name}-{'x'.join(['4'] * chip.torus_dims)}"
        )
    return table[chips]


_NAME = re.compile(r"^(?P<gen>[a-z0-9]+)-(?P<size>\d+(?:x\d+)*)$")


def parse_accelerator_type(name: str, num_slices: int = 1, costs: CostConstants | None = None) -> TPUTopology:
    """``"v5p-64"`` / ``"v6e-8x8"`` / ``"tpu7x-128"`` -> TPUTopology (naming in module docstring)."""
    match = _NAME.match(name.strip().lower())
    if not match:
        known = ", ".join(sorted(CHIP_GENERATIONS))
        raise ValueError(
            f"cannot parse TPU slice {name!r}: expected <generation>-<count> or <generation>-<shape> "
            f"such as v5p-64, v6e-8x8 (generations: {known})"
        )
    chip = chip_generation(match["gen"])
    size = match["size"]
    if "x" in size:
        shape = tuple(int(n) for n in size.split("x"))
    else:
        shape = default_shape(chip, chip.chips_from_name_count(int(size)))
    return TPUTopology(chip, shape, num_slices, costs or CostConstants())


def _mapping(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of keys to values, got {brief(data)}")
    return data


def _typed_override(cls: type, key: str, value: Any, where: str) -> Any:
    """``value`` for field ``key`` of ``cls`` (a chip or cost figure): numbers finite and > 0
    (``hbm_reserved_fraction``, ``chips_per_pod`` and the latencies may be 0), flags booleans."""
    kind = {f.name: f.type for f in fields(cls)}[key]
    if kind in ("bool", bool):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {brief(value)}")
        return value
    if kind in ("str", str):
        return str(value)
    may_be_zero = key in ("hbm_reserved_fraction", "chips_per_pod", "kernel_overhead_s", "collective_latency_s")
    return file_number(value, where, integer=kind in ("int", int), positive=not may_be_zero, minimum=0)


def _with_overrides(cls: type, base: Any, overrides: Any, where: str) -> Any:
    overrides = _mapping(overrides, where)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    typed = {key: _typed_override(cls, key, value, f"{where}.{key}") for key, value in overrides.items()}
    try:
        return replace(base, **typed)
    except ValueError as error:  # a range check of CostConstants
        raise ValueError(f"{where}: {error}") from None


def load_topology_file(path: str | Path) -> TPUTopology:
    """A topology from YAML/JSON: ``slice`` (e.g. "v5p-64") or ``generation`` + ``shape``, optional
    ``num_slices``, ``chip`` (overrides of ``ChipGeneration`` fields; ``hbm_gib`` accepted for
    ``hbm_bytes``) and ``costs`` (overrides of ``CostConstants``). Errors name the file and key."""
    path = Path(path)
    data = _mapping(read_structured(path), f"{path}: a topology file")
    allowed = {"slice", "generation", "shape", "num_slices", "chip", "costs", "name"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown topology keys {unknown}; known: {sorted(allowed)}")
    num_slices = file_number(data.get("num_slices", 1), f"{path}: num_slices", integer=True, positive=True)
    if "slice" in data:
        name = str(data["slice"])
    elif "generation" in data and "shape" in data:
        name = f"{data['generation']}-{data['shape']}"
    else:
        raise ValueError(f"{path}: give 'slice' (e.g. v5p-64) or both 'generation' and 'shape'")
    try:
        base = parse_accelerator_type(name, num_slices)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    chip_overrides = dict(_mapping(data.get("chip") or {}, f"{path}: chip"))
    if "hbm_gib" in chip_overrides:
        gib = file_number(chip_overrides.pop("hbm_gib"), f"{path}: chip.hbm_gib", positive=True)
        chip_overrides["hbm_bytes"] = int(gib * GIB)
    chip = _with_overrides(ChipGeneration, base.chip, chip_overrides, f"{path}: chip")
    costs = _with_overrides(CostConstants, base.costs, data.get("costs") or {}, f"{path}: costs")
    try:
        return TPUTopology(chip, base.shape, num_slices, costs)
    except ValueError as error:  # the overridden chip does not fit the slice
        raise ValueError(f"{path}: {error}") from None


def resolve_topology(spec: str, num_slices: int = 1) -> TPUTopology:
    """A slice name (``v5p-64``) or the path of a YAML/JSON topology file."""
    path = Path(spec)
    if path.suffix.lower() in (".yaml", ".yml", ".json") or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"topology file {spec!r} does not exist")
        topology = load_topology_file(path)
        return topology if num_slices == 1 else replace(topology, num_slices=num_slices)
    return parse_accelerator_type(spec, num_slices)
