import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecore.optimizers import Adagrad
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking, stack_rows, unstack_rows


def _plan(topology=SparseCoreTopology("v5p", 2), **kwargs):
    tables = [
        TableSpec("a", 1000, 16), TableSpec("b", 33, 13), TableSpec("c", 7, 16),
        TableSpec("d", 50, 16, combiner="mean"), TableSpec("e", 64, 8, optimizer=Adagrad(0.1)),
    ]
    features = [FeatureSpec("fa", "a", 32), FeatureSpec("fb", "b", 32), FeatureSpec("fa2", "a", 64),
                FeatureSpec("fc", "c", 32), FeatureSpec("fd", "d", 32), FeatureSpec("fe", "e", 32)]
    return plan_stacking(tables, features, topology, **kwargs)


def test_groups_by_padded_dim_optimizer_and_combiner_with_padding_rules():
    plan = _plan()
    assert [[t.table for t in s.tables] for s in plan.stacks] == [["a", "b", "c"], ["d"], ["e"]]
    abc = plan.stacks[0]
    n = 8  # 2 chips x 4 SparseCores
    assert abc.dim == 16
    assert [t.padded_vocab_size for t in abc.tables] == [1024, 64, 64]  # multiples of 8 x 8
    assert [t.row_offset_in_shard for t in abc.tables] == [0, 128, 136]
    assert [t.shard_rotation for t in abc.tables] == [0, 4, 0]  # rotation = SCs per device, mod N
    assert abc.vocab_size == 1152 and abc.shard_rows == 1152 // n
    # features in name order: fa (32 samples), fa2 (64), fb, fc
    assert [(f.feature, f.sample_offset, f.col_offset, f.col_shift) for f in abc.features] == [
        ("fa", 0, 0, 0), ("fa2", 32, 0, 0), ("fb", 96, 1024, 4), ("fc", 128, 1088, 0)]
    assert abc.max_ids_per_partition == 256  # jax-tpu-embedding's default for a multi-table stack
    assert plan.stacks[1].max_ids_per_partition == 256  # one table: its own limit
    # with_table_limits: a stack's partitions may carry the ids of all its tables
    assert plan.with_table_limits().stacks[0].max_ids_per_partition == 3 * 256
    assert [len(s.tables) for s in _plan(stack_tables=False).stacks] == [1] * 5


def test_activation_limit_splits_a_group():
    plan = _plan(activation_bytes_limit=16 * 4 * 8)  # room for one feature's pooled rows per SC
    assert [[t.table for t in s.tables] for s in plan.stacks][:3] == [["a"], ["b", "c"], ["d"]]


def test_batch_must_split_over_sparsecores():
    with pytest.raises(ValueError, match="'f'.*batch_size 12.*8 SparseCores"):
        plan_stacking([TableSpec("t", 10, 8)], [FeatureSpec("f", "t", 12)], SparseCoreTopology("v5p", 2))


def test_stack_unstack_round_trip_for_weights_and_row_slots():
    plan = _plan()
    stack = plan.stacks[0]
    weights = {p.table: plan.tables[p.table].init_weights(seed=3) for p in stack.tables}
    stacked = stack_rows(stack, weights)
    assert stacked.shape == (stack.vocab_size, stack.dim)
    back = unstack_rows(stack, stacked)
    for name, w in weights.items():
        assert torch.equal(back[name], w)
    # every logical row has its own physical row; padding rows and columns stay at the fill value
    rows = np.concatenate([stack.physical_rows(p.table, np.arange(p.vocab_size)) for p in stack.tables])
    assert np.unique(rows).size == rows.size
    pad_rows = np.setdiff1d(np.arange(stack.vocab_size), rows)
    assert torch.all(stacked[torch.from_numpy(pad_rows)] == 0)
    assert torch.all(stacked[torch.from_numpy(stack.physical_rows("b", np.arange(33))), 13:] == 0)
    slots = {p.table: torch.arange(p.vocab_size, dtype=torch.float32) for p in stack.tables}
    assert all(torch.equal(unstack_rows(stack, stack_rows(stack, slots))[k], v) for k, v in slots.items())
    assert stack.row_dims()[stack.physical_rows("b", np.array([5]))][0] == 13


def test_stack_rows_rejects_wrong_shapes():
    stack = _plan().stacks[0]
    good = {p.table: torch.zeros(p.vocab_size, p.dim) for p in stack.tables}
    with pytest.raises(ValueError, match="table 'b'.*\\(33, 13\\)"):
        stack_rows(stack, {**good, "b": torch.zeros(33, 12)})
    with pytest.raises(KeyError, match="'c'"):
        stack_rows(stack, {k: v for k, v in good.items() if k != "c"})


def test_layout_and_placement_match_jax_tpu_embedding():
    jte = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.table_stacking")
    import jax
    import jax.numpy as jnp
    from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec

    from sparsecore.jte_interop import jte_feature_specs

    topology = SparseCoreTopology("v5p", 2)
    tables = [TableSpec("a", 300, 8), TableSpec("b", 97, 5), TableSpec("c", 50, 8)]
    features = [FeatureSpec("fa", "a", 16), FeatureSpec("fb", "b", 16), FeatureSpec("fc", "c", 16)]
    plan = plan_stacking(tables, features, topology)
    stack = plan.stacks[0]
    # jax-tpu-embedding's own auto-stacking of the same (alphabetical) tables places them alike
    sgd = embedding_spec.SGDOptimizerSpec(learning_rate=0.01)
    theirs = {
        f.name: embedding_spec.FeatureSpec(
            name=f.name, input_shape=[16, 1], output_shape=[16, plan.tables[f.table].dim],
            table_spec=embedding_spec.TableSpec(
                name=f.table, vocabulary_size=plan.tables[f.table].vocab_size, embedding_dim=plan.tables[f.table].dim,
                initializer=jax.nn.initializers.zeros, optimizer=sgd, combiner="sum"))
        for f in features
    }
    embedding.auto_stack_tables(theirs, global_device_count=2, num_sc_per_device=4)
    for fp in stack.features:
        t = theirs[fp.feature].id_transformation
        assert (t.row_offset, t.col_offset, t.col_shift) == (fp.sample_offset, fp.col_offset, fp.col_shift)
    weights = {p.table: plan.tables[p.table].init_weights(seed=1) for p in stack.tables}
    ours = stack_rows(stack, weights, fill=float("nan")).numpy()
    specs = {name: spec.table_spec for name, spec in jte_feature_specs(plan).items()}
    stacked = jte.stack_and_shard_tables(
        {f.table: specs[f.name] for f in features}, {k: jnp.asarray(v.numpy()) for k, v in weights.items()}, 8)
    np.testing.assert_array_equal(np.asarray(stacked[stack.name]).reshape(ours.shape), ours)


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 20)), min_size=1, max_size=5),
    chips=st.sampled_from([1, 2, 4]),
    generation=st.sampled_from(["v5p", "v6e", "tpu7x"]),
    rotation=st.integers(0, 9),
)
def test_stacking_round_trips_for_any_shapes(shapes, chips, generation, rotation):
    topology = SparseCoreTopology(generation, chips)
    tables = [TableSpec(f"t{i}", v, d) for i, (v, d) in enumerate(shapes)]
    features = [FeatureSpec(f"f{i}", f"t{i}", 8 * topology.num_sparsecores) for i in range(len(tables))]
    plan = plan_stacking(tables, features, topology, rotation=rotation)
    for stack in plan.stacks:
        assert stack.dim % 8 == 0 and stack.vocab_size % (8 * topology.num_sparsecores) == 0
        weights = {p.table: plan.tables[p.table].init_weights(seed=0) for p in stack.tables}
        back = unstack_rows(stack, stack_rows(stack, weights))
        assert all(torch.equal(back[name], w) for name, w in weights.items())
        rows = np.concatenate([stack.physical_rows(p.table, np.arange(p.padded_vocab_size)) for p in stack.tables])
        np.testing.assert_array_equal(np.sort(rows), np.arange(stack.vocab_size))  # a bijection
