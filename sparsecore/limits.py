"""Partition limits: overflow policy, per-step stats, and the FDO helper that tunes the limits.

A partition is the set of ids one source SparseCore sends to one destination SparseCore for one
stacked table in one step. Stats are measured before any id is dropped (as jax-tpu-embedding
does), so FDO sees the true demand.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

# error: stop; drop: keep each partition's first ids up to its limits (as the SparseCores do);
# minibatch: split the batch into passes that fit (sparsecore.minibatching), 0 ids dropped
OVERFLOW_POLICIES = ("error", "drop", "minibatch")
ONE_PASS_POLICIES = ("error", "drop")  # what a consumer of one pass of CSR buffers can apply


def check_overflow_policy(overflow: str, policies: tuple[str, ...] = OVERFLOW_POLICIES, who: str = "") -> str:
    """``overflow`` if it is one of ``policies``, else ValueError (naming ``who`` takes them)."""
    if overflow not in policies:
        where = f" of {who}" if who else ""
        raise ValueError(f"overflow policy{where} must be one of {policies}, got {overflow!r}")
    return overflow


class PartitionOverflowError(ValueError):
    """A partition got more (unique) ids than its limit under the "error" policy. ``overflow``
    says which partition got how many; the message adds how this library's callers fix it (an
    application reports ``overflow`` with its own options instead)."""

    def __init__(self, overflow: str, fix: str = "raise the limit (see sparsecore.limits.FdoRecorder) or "
                                                 "use overflow='minibatch' or 'drop'") -> None:
        super().__init__(f"{overflow}; {fix}")
        self.overflow = overflow


@dataclass
class StackStats:
    """One step's demand on one stacked table.

    ``max_ids_per_partition`` / ``max_unique_ids_per_partition``: per destination SparseCore
    (length N), the largest count any source SparseCore sent it. ``required_buffer_size_per_sc``:
    per source SparseCore (length devices x SCs per device), the COO entries it needs (partitions
    rounded up to 8). ``dropped_ids``: ids dropped by the "drop" policy.
    """

    max_ids_per_partition: np.ndarray
    max_unique_ids_per_partition: np.ndarray
    required_buffer_size_per_sc: np.ndarray
    dropped_ids: int = 0

    def merge(self, other: StackStats) -> StackStats:
        """Element-wise max of the demands, sum of the drops (e.g. across steps or ranks)."""
        return StackStats(
            np.maximum(self.max_ids_per_partition, other.max_ids_per_partition),
            np.maximum(self.max_unique_ids_per_partition, other.max_unique_ids_per_partition),
            np.maximum(self.required_buffer_size_per_sc, other.required_buffer_size_per_sc),
            self.dropped_ids + other.dropped_ids,
        )


@dataclass(frozen=True)
class ProposedLimits:
    max_ids_per_partition: int
    max_unique_ids_per_partition: int
    required_buffer_size_per_sc: int


@dataclass
class FdoRecorder:
    """Feedback-directed optimisation of partition limits.

    ``record`` each step's stats; ``state`` is a plain dict of int64 arrays that a caller can
    all-reduce with MAX (and the drop counters with SUM) across ranks, then ``load`` back;
    ``propose`` returns the observed maxima times ``headroom``, rounded up to a multiple of 8.
    """

    stats: dict[str, StackStats] = field(default_factory=dict)
    steps: int = 0

    def record(self, step_stats: Mapping[str, StackStats]) -> None:
        for name, stats in step_stats.items():
            self.stats[name] = self.stats[name].merge(stats) if name in self.stats else stats
        self.steps += 1

    def state(self) -> dict[str, np.ndarray]:
        out = {}
        for name, s in self.stats.items():
            out[f"{name}/max_ids"] = s.max_ids_per_partition.astype(np.int64)
            out[f"{name}/max_unique_ids"] = s.max_unique_ids_per_partition.astype(np.int64)
            out[f"{name}/required_buffer"] = s.required_buffer_size_per_sc.astype(np.int64)
            out[f"{name}/dropped_ids"] = np.array([s.dropped_ids], dtype=np.int64)
        return out

    @staticmethod
    def merge_states(states: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """What an all-reduce would produce: max of the demands, sum of the drop counters."""
        merged: dict[str, np.ndarray] = {}
        for state in states:
            for key, value in state.items():
                if key not in merged:
                    merged[key] = np.array(value, dtype=np.int64)
                elif key.endswith("/dropped_ids"):
                    merged[key] = merged[key] + value
                else:
                    merged[key] = np.maximum(merged[key], value)
        return merged

    def load(self, state: Mapping[str, np.ndarray]) -> None:
        names = {key.rsplit("/", 1)[0] for key in state}
        self.stats = {
            name: StackStats(
                np.asarray(state[f"{name}/max_ids"]), np.asarray(state[f"{name}/max_unique_ids"]),
                np.asarray(state[f"{name}/required_buffer"]), int(state[f"{name}/dropped_ids"][0]),
            )
            for name in names
        }

    def all_reduce(self, group=None) -> None:
        """Merge the stats of all ranks in place over torch.distributed (MAX of demands, SUM of
        drops). Every rank must have recorded the same stacks."""
        import torch
        import torch.distributed as dist

        state = self.state()
        for key in sorted(state):
            tensor = torch.from_numpy(state[key])
            op = dist.ReduceOp.SUM if key.endswith("/dropped_ids") else dist.ReduceOp.MAX
            dist.all_reduce(tensor, op=op, group=group)
            state[key] = tensor.numpy()
        self.load(state)

    def propose(self, headroom: float = 1.2) -> dict[str, ProposedLimits]:
        """New limits per stack: observed maximum x headroom, rounded up to a multiple of 8."""
        if headroom < 1.0:
            raise ValueError(f"headroom must be >= 1.0, got {headroom}")

        def scaled(value: np.ndarray) -> int:
            return max(8, -(-math.ceil(int(np.max(value)) * headroom) // 8) * 8)

        out = {}
        for name, s in self.stats.items():
            max_ids = scaled(s.max_ids_per_partition)
            out[name] = ProposedLimits(
                max_ids, min(max_ids, scaled(s.max_unique_ids_per_partition)), scaled(s.required_buffer_size_per_sc)
            )
        return out
