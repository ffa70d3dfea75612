"""Per-table SparseCore id limits chosen from the tables themselves, as FDO would set them.

Feedback-directed optimisation sets each table's ``max_ids_per_partition`` to the most ids one
SparseCore partition saw in a step. Before any step has run, the planner estimates that from the
table's pooling factor and the global batch: the most ids any of the table's shardings sends one
partition (``ShardingOption.ids_per_partition``, skew included), rounded up to a multiple of 8 and
capped at ``MAX_IDS_PER_PARTITION_CEILING``. Tables that name their own limit keep it; after a
run, the limits ``train --fdo`` recorded replace the estimate (``plan --fdo-stats``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from sparsecore.fdo_stats import FdoStats
from torchrec_tpu.planner.cost_model import OptionBuilder
from torchrec_tpu.planner.tables import EmbeddingTable
from torchrec_tpu.topology import TPUTopology
from tpu_facts import ALIGNMENT, MAX_IDS_PER_PARTITION_CEILING, round_up


def auto_id_limits(tables: Sequence[EmbeddingTable], topology: TPUTopology, batch_size: int) -> dict[str, int]:
    """The estimated limit of every table without its own ``max_ids_per_partition``."""
    builder = OptionBuilder(topology, batch_size)
    limits = {}
    for t in tables:
        if t.max_ids_per_partition is None:
            need = max(o.ids_per_partition for o in builder.options(t))
            limits[t.name] = min(MAX_IDS_PER_PARTITION_CEILING, round_up(max(1, math.ceil(need)), ALIGNMENT))
    return limits


def fdo_id_limits(tables: Sequence[EmbeddingTable], stats: FdoStats, source: str) -> dict[str, int]:
    """The limits ``train --fdo`` recorded (``stats``, read from ``source``) for the tables they
    name: each its stack's ids limit (a bound on the table's share of it), rounded up to a multiple
    of 8. A table ``tables`` lacks is a ValueError."""
    recorded = stats.table_limits()
    unknown = sorted(set(recorded) - {t.name for t in tables})
    if unknown:
        raise ValueError(f"{source} has limits of {len(unknown)} table(s) the tables file lacks: "
                         f"{', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}")
    return {name: round_up(limit, ALIGNMENT) for name, limit in recorded.items()}


def with_id_limits(tables: Sequence[EmbeddingTable], limits: dict[str, int]) -> list[EmbeddingTable]:
    """``tables`` with the limits of ``limits`` set on the tables it names."""
    return [replace(t, max_ids_per_partition=limits[t.name]) if t.name in limits else t for t in tables]


def describe_id_limits(limits: dict[str, int], shown: int = 4) -> str:
    """``limits`` in one short line, largest first: every table when there are at most ``shown`` + 1,
    else ``128 to 4096: C21 4096, C22 3456, C20 1536, C23 1280, 22 more from 128 to 1152``."""
    ranked = sorted(limits.items(), key=lambda item: (-item[1], item[0]))
    if len({limit for _, limit in ranked}) == 1:
        return f"{ranked[0][1]} for all {len(ranked)} tables"
    head = ", ".join(f"{name} {limit}" for name, limit in ranked[: shown if len(ranked) > shown + 1 else None])
    if len(ranked) <= shown + 1:
        return head
    rest = [limit for _, limit in ranked[shown:]]
    return f"{ranked[-1][1]} to {ranked[0][1]}: {head}, {len(rest)} more from {min(rest)} to {max(rest)}"
