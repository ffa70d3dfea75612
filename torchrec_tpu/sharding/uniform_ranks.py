"""Every rank's local stacks with the same shapes, which one SPMD step program over the ranks
needs (every rank runs the same program, so every rank's tables, slots and CSR buffers must have
the same shapes; only their values differ).

A plan rarely gives that by itself: table-wise shards put different tables, hence different row
and feature counts, on each rank. Stacks group tables by (padded dim, optimizer, combiner); per
such key this module pads each rank up to the largest rank: a pad table of the missing rows and
pad features (no ids, ever) up to the largest feature count. Pads cost memory (a rank holds as
many rows per key as the largest rank, as jax-tpu-embedding's even sharding does) and no
compute beyond the empty samples. Their output columns are dropped; they are never saved.

:func:`uniform_padding` checks the result by stacking every rank's padded tables and comparing
the stacks; a plan it cannot even out raises :class:`UniformityError` saying what differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from sparsecore.limits import ProposedLimits
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import StackedTable, StackingPlan, plan_stacking
from tpu_facts import ALIGNMENT, round_up

PAD_PREFIX = "__uniform_pad"


class UniformityError(ValueError):
    """The ranks' local stacks cannot be padded to the same shapes."""


@dataclass(frozen=True)
class RankPadding:
    """What one rank adds to its local tables and features, and the partition limits (max ids,
    max unique ids) of its stacks in plan order: every rank's largest, so that every rank lays
    its CSR buffers out alike (empty: each stack its own)."""

    tables: tuple[TableSpec, ...] = ()
    features: tuple[FeatureSpec, ...] = ()
    stack_limits: tuple[tuple[int, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.tables or self.features)


def is_pad(name: str) -> bool:
    """Whether a table or feature name is a padding one."""
    return name.startswith(PAD_PREFIX)


def _key(table: TableSpec) -> tuple:
    return round_up(table.dim, ALIGNMENT), table.optimizer, table.combiner


def uniform_padding(tables: Sequence[Sequence[TableSpec]], features: Sequence[Sequence[FeatureSpec]],
                    topology: SparseCoreTopology) -> list[RankPadding]:
    """Per rank, the pads that give every rank's (``tables[r]``, ``features[r]``) stacks of the
    same shapes (all features of one batch size)."""
    n = topology.num_sparsecores
    batch = {f.batch_size for fs in features for f in fs}
    if len(batch) != 1:
        raise UniformityError(f"the local features have several batch sizes {sorted(batch)}")
    batch_size = batch.pop()
    keys: dict[tuple, TableSpec] = {}  # each key's first table: the pad table's template
    for rank_tables in tables:
        for t in rank_tables:
            keys.setdefault(_key(t), t)
    rows = [{k: 0 for k in keys} for _ in tables]
    count = [{k: 0 for k in keys} for _ in tables]
    for r, (rank_tables, rank_features) in enumerate(zip(tables, features)):
        by_name = {t.name: t for t in rank_tables}
        for t in rank_tables:
            rows[r][_key(t)] += round_up(t.vocab_size, ALIGNMENT * n)
        for f in rank_features:
            count[r][_key(by_name[f.table])] += 1
    most_rows = {k: max(r[k] for r in rows) for k in keys}
    # a pad table needs a feature of its own (a table no feature looks up is in no stack)
    most_features = {k: max(c[k] + (rows[r][k] < most_rows[k]) for r, c in enumerate(count)) for k in keys}
    pads = []
    for r, rank_tables in enumerate(tables):
        pad_tables, pad_features = [], []
        for i, (k, template) in enumerate(keys.items()):
            missing = most_rows[k] - rows[r][k]
            host = next((t.name for t in rank_tables if _key(t) == k), None)
            if missing:
                host = f"{PAD_PREFIX}_table_{i}"
                pad_tables.append(replace(template, name=host, vocab_size=missing, dim=k[0], initializer=None))
            pad_features += [FeatureSpec(f"{PAD_PREFIX}_feature_{i}_{j}", host, batch_size, weighted=True)
                             for j in range(most_features[k] - count[r][k])]
        pads.append(RankPadding(tuple(pad_tables), tuple(pad_features)))
    plans = [local_plan([*t, *p.tables], [*f, *p.features], topology) for t, f, p in zip(tables, features, pads)]
    if len({len(plan.stacks) for plan in plans}) == 1:
        # a stack's limits sum its tables' (``with_table_limits``), which differ between ranks
        limits = tuple((max(plan.stacks[i].max_ids_per_partition for plan in plans),
                        max(plan.stacks[i].max_unique_ids_per_partition for plan in plans))
                       for i in range(len(plans[0].stacks)))
        pads = [replace(pad, stack_limits=limits) for pad in pads]
    _check_same_stacks(tables, features, pads, topology)
    return pads


def local_plan(tables: Sequence[TableSpec], features: Sequence[FeatureSpec], topology: SparseCoreTopology,
               stack_limits: Sequence[tuple[int, int]] = ()) -> StackingPlan:
    """The stacking plan of one rank's backend: each multi-table stack limited by the sum of its
    tables' limits, or by ``stack_limits`` (per stack in plan order) where given."""
    plan = plan_stacking(list(tables), list(features), topology).with_table_limits()
    if not stack_limits:
        return plan
    return plan.with_limits({st.name: ProposedLimits(ids, unique, 0)
                             for st, (ids, unique) in zip(plan.stacks, stack_limits, strict=True)})


def stack_signature(stack: StackedTable) -> tuple:
    """What of a stack shapes a step program's tensors and ops."""
    return (stack.dim, stack.optimizer, stack.combiner, stack.num_sparsecores, stack.vocab_size,
            len(stack.features), stack.total_sample_count, stack.max_ids_per_partition,
            stack.max_unique_ids_per_partition)


def _check_same_stacks(tables: Sequence[Sequence[TableSpec]], features: Sequence[Sequence[FeatureSpec]],
                       pads: Sequence[RankPadding], topology: SparseCoreTopology) -> None:
    signatures = []
    for rank_tables, rank_features, pad in zip(tables, features, pads):
        plan = local_plan([*rank_tables, *pad.tables], [*rank_features, *pad.features], topology, pad.stack_limits)
        width = sum(plan.tables[f.table].dim for f in plan.features)  # the local activations' columns
        signatures.append([stack_signature(st) for st in plan.stacks] + [("width", width)])
        if width != sum(len(st.features) * st.dim for st in plan.stacks):
            raise UniformityError("tables narrower than their stack's padded dim (a multiple of 8) leave columns "
                                  "out of the activations; uniform ranks need dims that are multiples of 8")
    for r, signature in enumerate(signatures[1:], start=1):
        if signature != signatures[0]:
            raise UniformityError(f"padded, rank 0's stacks are {_describe(signatures[0])} but rank {r}'s are "
                                  f"{_describe(signature)}")


def _describe(signature: list[tuple]) -> str:
    *stacks, (_, width) = signature
    return "; ".join([*(f"dim {s[0]} {s[1].name} rows {s[4]} features {s[5]} limits {s[7]}/{s[8]}" for s in stacks),
                      f"{width} output columns"])
