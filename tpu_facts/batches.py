"""The batch size's three meanings, each with its own name, and the one conversion between them.

* ``global_batch``: the samples of one training step over all ranks (``--batch-size``,
  ``DataConfig.batch_size``, a plan's ``batch_size``); what a sharded table's backend looks up
  (every shard sees every rank's samples).
* ``local_batch``: one rank's share of it: what its reader yields and its model sees.
* ``padded_local_batch``: a rank's share padded with empty samples so that the ranks' padded
  batches together split evenly over each rank's SparseCores (a sharded EBC's lookup size).

Public names that TorchRec, jax-tpu-embedding, TorchTPU or the CLI fix (``batch_size``,
``device_batch_size``) keep them; their docstrings say which of these they hold.
"""

from __future__ import annotations

import math


def local_batch_of(global_batch: int, world_size: int) -> int:
    """Each of ``world_size`` ranks' share of ``global_batch`` samples; ValueError unless it splits evenly."""
    if global_batch < 1 or world_size < 1:
        raise ValueError(f"a global batch of {global_batch} samples over {world_size} ranks: both must be >= 1")
    if global_batch % world_size:
        raise ValueError(f"a global batch of {global_batch} does not split over {world_size} ranks "
                         f"(nearest multiples: {global_batch // world_size * world_size or world_size}, "
                         f"{-(-global_batch // world_size) * world_size})")
    return global_batch // world_size


def global_batch_of(local_batch: int, world_size: int) -> int:
    """The samples of ``world_size`` ranks' batches of ``local_batch`` (or padded local batches) together."""
    return local_batch * world_size


def padded_local_batch_of(local_batch: int, num_sparsecores: int, world_size: int) -> int:
    """``local_batch`` rounded up to the smallest size whose ``world_size`` copies split evenly over
    ``num_sparsecores`` SparseCores (a multiple of ``num_sparsecores / gcd(num_sparsecores, world_size)``)."""
    if local_batch < 1 or num_sparsecores < 1 or world_size < 1:
        raise ValueError(f"padded_local_batch_of({local_batch}, {num_sparsecores}, {world_size}): "
                         "the local batch, SparseCores and ranks must each be >= 1")
    multiple = num_sparsecores // math.gcd(num_sparsecores, world_size)
    return -(-local_batch // multiple) * multiple
