"""Padding every rank's local tables to stacks of one shape (what one SPMD step program needs),
checked against the stacking of the padded specs, hand-counted pads, and the cases it refuses."""

from __future__ import annotations

import pytest

from sparsecore.optimizers import SGD, Adagrad
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from torchrec_tpu.sharding.uniform_ranks import UniformityError, is_pad, stack_signature, uniform_padding

TOPOLOGY = SparseCoreTopology()
BATCH = 64


def _features(*tables: str) -> list[FeatureSpec]:
    return [FeatureSpec(f"{t}_f{i}", t, BATCH, weighted=True) for i, t in enumerate(tables)]


def _stacks(tables, features, pad):
    plan = plan_stacking([*tables, *pad.tables], [*features, *pad.features], TOPOLOGY)
    return [stack_signature(st) for st in plan.stacks]


def test_table_wise_ranks_are_padded_to_the_largest() -> None:
    rows = 8 * TOPOLOGY.num_sparsecores  # one padded block of rows
    tables = [[TableSpec("big", 3 * rows, 16)],
              [TableSpec("small", rows, 16), TableSpec("narrow", rows, 8)]]
    features = [_features("big"), _features("small", "small", "narrow")]
    pads = uniform_padding(tables, features, TOPOLOGY)
    signatures = [_stacks(t, f, p) for t, f, p in zip(tables, features, pads)]
    assert signatures[0] == signatures[1]
    # dim 16: rank 1 pads 2 blocks of rows, as a table of its own with a feature (3 features); rank
    # 0 pads 2 features on its table. dim 8: rank 0 pads a table of its own with a feature
    assert [(t.dim, t.vocab_size) for t in pads[0].tables] == [(8, rows)]
    assert sorted(f.table for f in pads[0].features) == [pads[0].tables[0].name, "big", "big"]
    # rank 1: the dim-16 rows it lacks, as a table its one pad feature looks up
    assert [(t.dim, t.vocab_size) for t in pads[1].tables] == [(16, 2 * rows)]
    assert [f.table for f in pads[1].features] == [pads[1].tables[0].name]
    assert all(is_pad(t.name) for p in pads for t in p.tables)
    assert all(is_pad(f.name) and f.batch_size == BATCH and f.weighted for p in pads for f in p.features)


def test_ranks_of_one_shape_get_no_pads() -> None:
    tables = [[TableSpec(f"t{r}", 100, 16)] for r in range(3)]
    features = [_features(f"t{r}") for r in range(3)]
    assert not any(uniform_padding(tables, features, TOPOLOGY))


def test_stacks_in_another_order_on_each_rank_are_refused_naming_both() -> None:
    # a stack's place follows its first feature's name, which a pad feature can take: the two
    # ranks' (sgd, adagrad) stacks come out in opposite orders
    tables = [[TableSpec("a", 64, 16, optimizer=SGD(learning_rate=0.1))],
              [TableSpec("b", 64, 16, optimizer=Adagrad(learning_rate=0.1))]]
    with pytest.raises(UniformityError, match="rank 0's stacks are dim 16 adagrad .* rank 1's are dim 16 sgd"):
        uniform_padding(tables, [_features("a"), _features("b")], TOPOLOGY)


def test_dims_off_the_alignment_are_refused_with_the_reason() -> None:
    tables = [[TableSpec("a", 64, 12)], [TableSpec("b", 64, 16)]]
    with pytest.raises(UniformityError, match="multiples of 8"):
        uniform_padding(tables, [_features("a"), _features("b")], TOPOLOGY)


def test_features_of_several_batch_sizes_are_refused() -> None:
    tables = [[TableSpec("a", 64, 16)], [TableSpec("b", 64, 16)]]
    features = [_features("a"), [FeatureSpec("b_f", "b", 2 * BATCH, weighted=True)]]
    with pytest.raises(UniformityError, match="batch sizes"):
        uniform_padding(tables, features, TOPOLOGY)


def test_every_rank_lays_its_stacks_out_with_the_largest_summed_id_limits() -> None:
    """A stack's limits sum its tables' (``with_table_limits``): with different tables on each rank
    they differed, so ranks laid their CSR buffers out differently and their SPMD step programs
    did not match (``--dense-device tpu`` at two ranks failed on its first step)."""
    from torchrec_tpu.sharding.uniform_ranks import local_plan

    rows = 8 * TOPOLOGY.num_sparsecores
    tables = [[TableSpec("a", rows, 16, max_ids_per_partition=64, max_unique_ids_per_partition=32),
               TableSpec("b", rows, 16, max_ids_per_partition=64, max_unique_ids_per_partition=32)],
              [TableSpec("c", rows, 16, max_ids_per_partition=512, max_unique_ids_per_partition=16),
               TableSpec("d", rows, 16, max_ids_per_partition=8, max_unique_ids_per_partition=8)]]
    features = [_features("a", "b"), _features("c", "d")]
    own = [plan_stacking([*t], [*f], TOPOLOGY).with_table_limits().stacks[0] for t, f in zip(tables, features)]
    assert (own[0].max_ids_per_partition, own[1].max_ids_per_partition) == (128, 520)  # what differed
    pads = uniform_padding(tables, features, TOPOLOGY)
    plans = [local_plan([*t, *p.tables], [*f, *p.features], TOPOLOGY, p.stack_limits)
             for t, f, p in zip(tables, features, pads)]
    assert [stack_signature(st) for st in plans[0].stacks] == [stack_signature(st) for st in plans[1].stacks]
    assert [(st.max_ids_per_partition, st.max_unique_ids_per_partition) for st in plans[0].stacks] == [(520, 64)]
