"""Pure facts about Cloud TPU hardware and the SparseCore data layout.

Standard library only: importing this package starts no device, imports neither torch nor JAX
and changes no process-wide setting, so the planner (``torchrec-tpu plan``), the SparseCore
engine and the ``tpu`` device all read the same figures without paying for each other.

* ``tpu_facts.batches``: the batch size's three meanings (global, local, padded local) and their conversion.
* ``tpu_facts.chips``: per-chip figures of each TPU generation (``ChipGeneration``).
* ``tpu_facts.layout``: alignment, id limits, combiners, ``round_up``, ``ShardingKind``, optimizer slots.
* ``tpu_facts.sizes``: ``GIB``, the power-of-two, quarter- and eighth-power buckets of variable sizes.
* ``tpu_facts.slices``: ``Slice``, a torus of chips (every derived count), ``check_mod_sharding``.
"""

from tpu_facts.batches import global_batch_of, local_batch_of, padded_local_batch_of
from tpu_facts.chips import CHIP_GENERATIONS, ChipGeneration, chip_generation
from tpu_facts.layout import (
    ALIGNMENT,
    COMBINERS,
    DEFAULT_MAX_IDS_PER_PARTITION,
    MAX_IDS_PER_PARTITION_CEILING,
    MAX_MINIBATCHES,
    MAX_VOCAB,
    OPTIMIZER_SLOTS,
    PADDING_ID,
    ShardingKind,
    round_up,
)
from tpu_facts.sizes import GIB, eighth_bucket, power_of_two_bucket, quarter_bucket
from tpu_facts.slices import DeviceCounts, Slice, check_mod_sharding

__all__ = [
    "ALIGNMENT", "CHIP_GENERATIONS", "COMBINERS", "DEFAULT_MAX_IDS_PER_PARTITION", "GIB",
    "MAX_IDS_PER_PARTITION_CEILING", "MAX_MINIBATCHES", "MAX_VOCAB",
    "OPTIMIZER_SLOTS", "PADDING_ID", "ChipGeneration", "DeviceCounts", "ShardingKind", "Slice", "check_mod_sharding",
    "chip_generation", "eighth_bucket", "global_batch_of", "local_batch_of", "padded_local_batch_of",
    "power_of_two_bucket", "quarter_bucket", "round_up",
]
