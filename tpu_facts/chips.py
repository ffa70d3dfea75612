"""Per-chip facts of Cloud TPU generations (pure data; standard library only).

Sources (checked 2026-12):

* [cmp] Google Cloud, "TPU7x (Ironwood)" system-architecture table comparing v5p / v6e / TPU7x
  (cloud.google.com/tpu/docs/tpu7x): chips per pod, bf16 peak, HBM capacity (GiB) and bandwidth,
  TensorCores and SparseCores per chip, bidirectional ICI bandwidth per chip, DCN per chip.
* [v5p] cloud.google.com/tpu/docs/v5p: 3D torus, ICI 4,800 Gbps, slice shapes 2x2x1 .. 16x16x24,
  largest single slice 6,144 chips (96 cubes of 4x4x4); accelerator types count TensorCores.
* [v6e] cloud.google.com/tpu/docs/v6e: 2D torus, 256-chip pod, shapes 1x1 .. 16x16, 8 chips per
  host, accelerator types count chips (v6e-256 = 256 chips).
* [7x-names] Ironwood quick starts create a 4-chip VM (GKE machine type tpu7x-standard-4t) with
  ``gcloud ... --accelerator-type=tpu7x-8``; AOT compile guides note "tpu7x-128 = 128 devices =
  64 chips". So tpu7x names count TensorCores (= JAX devices), like v5p.
* [jte] jax-tpu-embedding 0.1.0 ``utils.NUM_SC_PER_DEVICE_MAP``: 4 SparseCores per JAX device on
  v5p, 2 on v6e, 2 on TPU7x "megacore disabled" -- TPU7x exposes each of its two chiplets
  (one TensorCore + two SparseCores) as its own JAX device, so a chip has 4 SparseCores. No
  entry for v5e ("TPU v5 lite") or v4.
* [v5e] cloud.google.com/tpu/docs/v5e: 16 GiB HBM2, 819 GB/s, 197 TFLOP/s bf16, ICI 1,600 Gbps,
  2D torus, 256 chips per pod.
* [v4] cloud.google.com/tpu/docs/v4: 32 GiB HBM2, 1,228 GB/s, 275 TFLOP/s bf16, ICI 2,400 Gbps,
  3D torus, 4,096 chips per pod, accelerator types count TensorCores.

Units: bytes and bytes/second. ``ici_bandwidth_bytes_per_s`` is one direction, all links of one
chip together (half of [cmp]'s bidirectional figure). Slice shapes, ICI/DCN topology and planner
costs build on this in ``torchrec_tpu.topology``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpu_facts.sizes import GIB


@dataclass(frozen=True)
class ChipGeneration:
    """One TPU generation's per-chip figures and naming convention."""

    name: str
    sparsecores_per_chip: int
    tensorcores_per_chip: int
    hbm_bytes: int
    hbm_bandwidth_bytes_per_s: float
    ici_bandwidth_bytes_per_s: float  # per chip, all links, one direction
    peak_bf16_flops: float
    torus_dims: int  # 3 for a 3D torus (v5p, tpu7x), 2 for v6e
    max_chips_per_slice: int
    dcn_bandwidth_bytes_per_s: float = 0.0  # per chip, for multislice
    devices_per_chip: int = 1  # JAX devices one chip shows up as
    name_counts_tensorcores: bool = False  # "v5p-64" counts TensorCores; "v6e-64" counts chips
    chips_per_host: int = 4
    chips_per_pod: int = 0

    @property
    def sparsecores_per_device(self) -> int:
        return self.sparsecores_per_chip // self.devices_per_chip

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.hbm_bytes // self.devices_per_chip

    def chips_from_name_count(self, count: int) -> int:
        """Chips in an accelerator type ``<gen>-<count>`` (e.g. v5p-64 -> 32 chips)."""
        if not self.name_counts_tensorcores:
            return count
        if count % self.tensorcores_per_chip:
            raise ValueError(
                f"{self.name}-{count}: {self.name} names count TensorCores "
                f"({self.tensorcores_per_chip} per chip), so the count must be a multiple of "
                f"{self.tensorcores_per_chip}"
            )
        return count // self.tensorcores_per_chip

    def name_count_from_chips(self, chips: int) -> int:
        return chips * self.tensorcores_per_chip if self.name_counts_tensorcores else chips


CHIP_GENERATIONS: dict[str, ChipGeneration] = {
    # v5p [cmp][v5p]: 95 GiB HBM2e at 2,765 GB/s; ICI 1,200 GB/s bidirectional (= 4,800 Gbps one
    # way); DCN 50 Gb/s per chip; 459 TFLOP/s bf16; pod 8,960 chips, one slice at most 6,144.
    "v5p": ChipGeneration(
        "v5p", 4, 2, 95 * GIB, 2765e9, 1200e9 / 2, 459e12, 3, 6144,
        dcn_bandwidth_bytes_per_s=50e9 / 8, devices_per_chip=1, name_counts_tensorcores=True,
        chips_per_host=4, chips_per_pod=8960,
    ),
    # v6e / Trillium [cmp][v6e]: 32 GiB HBM at 1,638 GB/s; ICI 800 GB/s bidirectional ([cmp]; the
    # v6e page's older "3,584 Gbps" is higher -- we take the newer, lower figure); DCN 100 Gb/s per
    # chip; 918 TFLOP/s bf16; 2D torus; 256 chips per pod and slice; 8 chips per host.
    "v6e": ChipGeneration(
        "v6e", 2, 1, 32 * GIB, 1638e9, 800e9 / 2, 918e12, 2, 256,
        dcn_bandwidth_bytes_per_s=100e9 / 8, devices_per_chip=1, name_counts_tensorcores=False,
        chips_per_host=8, chips_per_pod=256,
    ),
    # tpu7x / Ironwood [cmp][jte][7x-names]: 192 GiB HBM3e at 7,380 GB/s; ICI 1,200 GB/s bidirectional; DCN
    # 100 Gb/s per chip; 2,307 TFLOP/s bf16; 3D torus, pod 9,216 chips. Two chiplets per chip, each
    # a JAX device with one TensorCore and two SparseCores; accelerator types count TensorCores
    # ("tpu7x-8" = 4 chips = 8 devices). Max single-slice size is not published: we allow a pod.
    "tpu7x": ChipGeneration(
        "tpu7x", 4, 2, 192 * GIB, 7380e9, 1200e9 / 2, 2307e12, 3, 9216,
        dcn_bandwidth_bytes_per_s=100e9 / 8, devices_per_chip=2, name_counts_tensorcores=True,
        chips_per_host=4, chips_per_pod=9216,
    ),
    # v5e [v5e]: 16 GiB HBM2 at 819 GB/s; ICI 1,600 Gbps (200 GB/s one way); 197 TFLOP/s bf16; 2D
    # torus, 256 chips per pod and slice; names count chips. No SparseCore: jax-tpu-embedding has no
    # SparseCore count for it ("TPU v5 lite"), so the planner refuses it ([jte]).
    "v5e": ChipGeneration(
        "v5e", 0, 1, 16 * GIB, 819e9, 1600e9 / 8, 197e12, 2, 256,
        devices_per_chip=1, name_counts_tensorcores=False, chips_per_host=8, chips_per_pod=256,
    ),
    # v4 [v4]: 32 GiB HBM2 at 1,228 GB/s; ICI 2,400 Gbps (300 GB/s one way); 275 TFLOP/s bf16; 3D
    # torus, 4,096 chips per pod; two TensorCores as one JAX device (megacore); names count
    # TensorCores (v4-8 = 4 chips). Its SparseCores serve TensorFlow's TPUEmbedding; jax-tpu-embedding
    # does not drive them ([jte]), so they count as 0 here and the planner refuses v4.
    "v4": ChipGeneration(
        "v4", 0, 2, 32 * GIB, 1228e9, 2400e9 / 8, 275e12, 3, 4096,
        devices_per_chip=1, name_counts_tensorcores=True, chips_per_host=4, chips_per_pod=4096,
    ),
}


def chip_generation(name: str) -> ChipGeneration:
    """Look up a chip generation by name ("v5p", "v6e", "tpu7x"), with a clear error otherwise."""
    try:
        return CHIP_GENERATIONS[name.lower()]
    except KeyError:
        known = ", ".join(sorted(CHIP_GENERATIONS))
        raise ValueError(f"unknown TPU generation {name!r}; known generations: {known}") from None
