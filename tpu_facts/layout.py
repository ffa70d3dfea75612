"""SparseCore data-layout facts shared by the engine (``sparsecore``) and the planner.

Values follow jax-tpu-embedding 0.1.0: rows and dims are padded to multiples of ``ALIGNMENT``;
ids travel as int32 and ``PADDING_ID`` (2^31-1) marks padding, so a table holds at most
``MAX_VOCAB`` rows; one SparseCore takes at most ``DEFAULT_MAX_IDS_PER_PARTITION`` ids from one
source SparseCore per step unless a table says otherwise, and never more than
``MAX_IDS_PER_PARTITION_CEILING``. ``ShardingKind`` names how a table is
split over devices (the planner's and the sharded modules' one vocabulary); ``OPTIMIZER_SLOTS``
the slot tables each SparseCore optimizer keeps next to a table's weights.
"""

from __future__ import annotations

from enum import StrEnum

ALIGNMENT = 8
PADDING_ID = 2**31 - 1
MAX_VOCAB = PADDING_ID
DEFAULT_MAX_IDS_PER_PARTITION = 256
# The largest id limit the planner sets by itself. jax-tpu-embedding publishes no maximum (its FDO
# raises limits to the observed maxima, bounded by one SparseCore's SPMEM); this cap is our assumption,
# and an explicit --max-ids-per-partition or a table's own limit may exceed it.
MAX_IDS_PER_PARTITION_CEILING = 4096
MAX_MINIBATCHES = 64  # a batch's most minibatches (jax-tpu-embedding's kMaxMinibatchingBuckets)
COMBINERS = ("sum", "mean", "sqrtn")


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


class ShardingKind(StrEnum):
    """How a table is split over devices (TorchRec's names; members equal their names as str)."""

    TABLE_WISE = "table_wise"  # the whole table on one device
    ROW_WISE = "row_wise"  # rows mod-sharded over all devices
    COLUMN_WISE = "column_wise"  # column blocks, each on one device
    DATA_PARALLEL = "data_parallel"  # a replica on every device


# Slot tables per optimizer (jax-tpu-embedding's SparseCore optimizers): (slots holding one value
# per element, slots holding one value per row). sparsecore's OptimizerSpecs take theirs from here.
OPTIMIZER_SLOTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sgd": ((), ()),
    "adagrad": (("accumulator",), ()),
    "rowwise_adagrad": ((), ("accumulator",)),
    "adagrad_momentum": (("accumulator", "momentum"), ()),
    "adam": (("momentum", "velocity"), ()),
    "lazy_adam": (("momentum", "velocity"), ()),
    "ftrl": (("accumulator", "linear"), ()),
}
