"""Per-chip facts of Cloud TPU generations (pure data; no JAX or torch needed).

Figures are per chip, from Google Cloud's public TPU system-architecture pages
(cloud.google.com/tpu/docs/v5p, /v6e, /tpu7x) and jax-tpu-embedding's SparseCore constants for the
SparseCore counts. Slice shapes, ICI/DCN topology and planner costs build on this in
``torchrec_tpu.topology``.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class ChipGeneration:
    name: str
    sparsecores_per_chip: int
    tensorcores_per_chip: int
    hbm_bytes: int
    hbm_bandwidth_bytes_per_s: float
    ici_bandwidth_bytes_per_s: float  # per chip, all links, one direction
    peak_bf16_flops: float
    torus_dims: int  # 3 for a 3D torus (v5p, tpu7x), 2 for v6e
    max_chips_per_slice: int


CHIP_GENERATIONS: dict[str, ChipGeneration] = {
    # v5p: 95 GB HBM2e at 2,765 GB/s, 4,800 Gbps ICI, 459 TFLOP/s bf16, 3D torus, pods of 8,960.
    "v5p": ChipGeneration("v5p", 4, 2, 95 * 10**9, 2765e9, 4800e9 / 8, 459e12, 3, 8960),
    # v6e (Trillium): 32 GB HBM at 1,640 GB/s, 3,584 Gbps ICI, 918 TFLOP/s bf16, 2D torus, 256 chips.
    "v6e": ChipGeneration("v6e", 2, 1, 32 * 10**9, 1640e9, 3584e9 / 8, 918e12, 2, 256),
    # tpu7x (Ironwood): 192 GB HBM at 7.37 TB/s, 1.2 TB/s ICI, 2,307 TFLOP/s bf16, 3D torus, 9,216.
    "tpu7x": ChipGeneration("tpu7x", 2, 2, 192 * 10**9, 7370e9, 1200e9 / 2, 2307e12, 3, 9216),
}


def chip_generation(name: str) -> ChipGeneration:
    """Look up a chip generation by name ("v5p", "v6e", "tpu7x"), with a clear error otherwise."""
    try:
        return CHIP_GENERATIONS[name.lower()]
    except KeyError:
        known = ", ".join(sorted(CHIP_GENERATIONS))
        raise ValueError(f"unknown TPU generation {name!r}; known generations: {known}") from None
