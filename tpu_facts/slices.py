"""A TPU slice: chips of one generation in a torus shape, possibly several slices over DCN.

``Slice`` is the one description of "which hardware" shared by the planner (which adds its cost
constants in ``torchrec_tpu.topology.TPUTopology``), a plan JSON, the device mesh
(``torch_tpu.distributed.mesh``) and the SparseCore engine (``sparsecore.SparseCoreTopology``
takes its per-rank share of a slice). Every count derived from the chip figures lives here.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from tpu_facts.chips import ChipGeneration, chip_generation


def check_mod_sharding(num_sparsecores: int, what: str) -> None:
    """SparseCore mod sharding splits ids by ``id % num_sparsecores``: the count must be a power of two."""
    if num_sparsecores < 1 or num_sparsecores & (num_sparsecores - 1):
        raise ValueError(f"{what}: SparseCore mod sharding needs a power-of-two SparseCore count, "
                         f"got {num_sparsecores}")


class DeviceCounts:
    """SparseCore and memory counts of ``num_devices`` JAX devices of one ``chip`` generation
    (a base of :class:`Slice` and of the engine's ``sparsecore.SparseCoreTopology``)."""

    chip: ChipGeneration
    num_devices: int

    @property
    def sparsecores_per_device(self) -> int:
        return self.chip.sparsecores_per_device

    @property
    def num_sparsecores(self) -> int:
        return self.num_devices * self.sparsecores_per_device

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.chip.hbm_bytes_per_device


@dataclass(frozen=True)
class Slice(DeviceCounts):
    """``num_slices`` identical slices of ``shape`` chips (one entry per torus dimension)."""

    chip: ChipGeneration
    shape: tuple[int, ...]
    num_slices: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if len(self.shape) != self.chip.torus_dims or min(self.shape, default=0) < 1:
            want = "x".join(["N"] * self.chip.torus_dims)
            raise ValueError(f"{self.chip.name} slice topology must be {want} with every N >= 1, got "
                             f"{'x'.join(map(str, self.shape))}")
        if self.chips_per_slice > self.chip.max_chips_per_slice:
            raise ValueError(f"{self.name}: {self.chips_per_slice} chips exceeds the largest "
                             f"{self.chip.name} slice ({self.chip.max_chips_per_slice} chips)")
        if not isinstance(self.num_slices, int) or self.num_slices < 1:
            raise ValueError(f"num_slices must be an int >= 1, got {self.num_slices!r}")

    @classmethod
    def from_env(cls, generation: str | None = None) -> Slice:
        """From TPU_TOPOLOGY, TPU_NUM_SLICES (or MEGASCALE_NUM_SLICES) and TPU_ACCELERATOR_TYPE."""
        topology = os.environ.get("TPU_TOPOLOGY")
        if not topology:
            raise ValueError("TPU_TOPOLOGY is not set; set it to the slice shape, e.g. 2x2x4")
        try:
            shape = tuple(int(n) for n in topology.lower().split("x"))
        except ValueError:
            raise ValueError(f"TPU_TOPOLOGY={topology!r} is not a shape such as 2x2x4") from None
        generation = generation or os.environ.get("TPU_ACCELERATOR_TYPE", "").split("-")[0]
        if not generation:
            raise ValueError("cannot tell the TPU generation: pass generation= or set TPU_ACCELERATOR_TYPE "
                             "(e.g. v5p-32)")
        slices = os.environ.get("TPU_NUM_SLICES") or os.environ.get("MEGASCALE_NUM_SLICES") or "1"
        return cls(chip_generation(generation), shape, int(slices))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Slice:
        """Inverse of :meth:`to_dict` (a plan's ``topology``); the recorded chip figures win over
        the built-in generation's, so a plan made with a custom topology file stays faithful."""
        chip = ChipGeneration(**data["chip"]) if "chip" in data else chip_generation(data["generation"])
        shape = data["shape"]
        shape = tuple(int(n) for n in shape.split("x")) if isinstance(shape, str) else tuple(shape)
        return cls(chip, shape, int(data.get("num_slices", 1)))

    def to_dict(self) -> dict[str, Any]:
        """The slice as plain data: name, generation, shape, num_slices and the chip figures."""
        return {"name": self.name, "generation": self.chip.name, "shape": self.shape_str,
                "num_slices": self.num_slices, "chip": asdict(self.chip)}

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """Physical axes of one slice as (name, size), fastest-enumerated first: the chip's
        devices ("core", when it has several), then the torus x, y(, z)."""
        torus = tuple(zip(("x", "y", "z"), self.shape))
        core = self.chip.devices_per_chip
        return (("core", core),) * (core > 1) + torus

    @property
    def name(self) -> str:
        base = f"{self.chip.name}-{self.chip.name_count_from_chips(self.chips_per_slice)}"
        return base if self.num_slices == 1 else f"{base} x{self.num_slices} slices"

    @property
    def shape_str(self) -> str:
        return "x".join(map(str, self.shape))

    @property
    def chips_per_slice(self) -> int:
        return math.prod(self.shape)

    @property
    def num_chips(self) -> int:
        return self.chips_per_slice * self.num_slices

    @property
    def devices_per_slice(self) -> int:
        return self.chips_per_slice * self.chip.devices_per_chip

    @property
    def num_devices(self) -> int:
        return self.devices_per_slice * self.num_slices

    def devices_per_rank(self, world_size: int) -> int:
        """JAX devices each of ``world_size`` equal ranks drives (ValueError if they do not divide)."""
        if world_size < 1 or self.num_devices % world_size:
            raise ValueError(f"{self.name} has {self.num_devices} devices, which {world_size} ranks "
                             "cannot split evenly")
        return self.num_devices // world_size
