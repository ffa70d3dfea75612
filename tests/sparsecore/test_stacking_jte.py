"""plan_stacking vs jax-tpu-embedding's own ``auto_stack_tables`` on random models given in any order."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecore.optimizers import SGD, Adagrad
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking, stack_rows

table_stacking = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.table_stacking")
jax = pytest.importorskip("jax")
from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec  # noqa: E402

from sparsecore.jte_interop import jte_optimizer  # noqa: E402

NAMES = [f"{a}{b}" for a in "qwertzuiop" for b in "xyz0"]


def _their_features(tables, features):
    """jax-tpu-embedding specs of the same model, built from the raw table/feature fields."""
    specs = {
        t.name: embedding_spec.TableSpec(
            name=t.name, vocabulary_size=t.vocab_size, embedding_dim=t.dim, initializer=jax.nn.initializers.zeros,
            optimizer=jte_optimizer(t.optimizer), combiner=t.combiner, max_ids_per_partition=t.max_ids_per_partition,
            max_unique_ids_per_partition=t.max_unique_ids_per_partition)
        for t in tables
    }
    dims = {t.name: t.dim for t in tables}
    return {f.name: embedding_spec.FeatureSpec(name=f.name, table_spec=specs[f.table], input_shape=[f.batch_size, 1],
                                               output_shape=[f.batch_size, dims[f.table]])
            for f in features}


@st.composite
def _models(draw):
    topology = SparseCoreTopology(draw(st.sampled_from(["v5p", "v6e", "tpu7x"])), draw(st.sampled_from([1, 2, 4])))
    n = topology.num_sparsecores
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=8, unique=True))
    tables = []
    for name in names:
        limit = draw(st.sampled_from([64, 256, 1024]))
        tables.append(TableSpec(
            name, draw(st.integers(1, 3000)), draw(st.sampled_from([4, 8, 13, 16, 64])),
            draw(st.sampled_from(["sum", "mean", "sqrtn"])), draw(st.sampled_from([SGD(0.1), Adagrad(0.05)])),
            max_ids_per_partition=limit, max_unique_ids_per_partition=limit // 2))
    feature_names = draw(st.lists(st.sampled_from(NAMES), min_size=len(names), max_size=len(names) + 6, unique=True))
    # every table is looked up at least once; the rest of the features pick any table
    owners = names + [draw(st.sampled_from(names)) for _ in feature_names[len(names):]]
    owners = draw(st.permutations(owners))
    features = [FeatureSpec(f, t, n * draw(st.sampled_from([1, 8, 64, 512]))) for f, t in zip(feature_names, owners)]
    return topology, draw(st.permutations(tables)), draw(st.permutations(features))


@settings(max_examples=40, deadline=None)
@given(model=_models(), activation_limit=st.sampled_from([2048 * 1024, 64 * 1024]), custom_limits=st.booleans())
def test_plan_equals_auto_stack_tables_for_any_input_order(model, activation_limit, custom_limits):
    topology, tables, features = model
    limits = {}
    if custom_limits:  # the callables see the stack name and its total sample count, as jax-tpu-embedding's
        limits = dict(stack_to_max_ids_per_partition=lambda name, samples: 8 * len(name) + samples,
                      stack_to_max_unique_ids_per_partition=lambda name, samples: samples // 2 + 8)
    plan = plan_stacking(tables, features, topology, activation_bytes_limit=activation_limit, **limits)
    theirs = _their_features(tables, features)
    table_stacking.auto_stack_tables(theirs, global_device_count=topology.num_devices,
                                     num_sc_per_device=topology.sparsecores_per_device,
                                     activation_mem_bytes_limit=activation_limit, **limits)
    their_stacks = {}
    for f in jax.tree.leaves(theirs):
        their_stacks.setdefault(f.table_spec.stacked_table_spec.stack_name, {})[f.table_spec.name] = f.table_spec
    assert [s.name for s in plan.stacks] == list(their_stacks)
    for stack in plan.stacks:
        assert [t.table for t in stack.tables] == list(their_stacks[stack.name])
        spec = next(iter(their_stacks[stack.name].values())).stacked_table_spec
        assert (stack.vocab_size, stack.dim, stack.total_sample_count, stack.max_ids_per_partition,
                stack.max_unique_ids_per_partition) == (
            spec.stack_vocab_size, spec.stack_embedding_dim, spec.total_sample_count, spec.max_ids_per_partition,
            spec.max_unique_ids_per_partition)
        for placement in stack.tables:
            setting = their_stacks[stack.name][placement.table].setting_in_stack
            assert (placement.padded_vocab_size, placement.row_offset_in_shard, placement.shard_rotation) == (
                setting.padded_vocab_size, setting.row_offset_in_shard, setting.shard_rotation)
        assert [f.feature for f in stack.features] == sorted(f.feature for f in stack.features)
        for fp in stack.features:
            t = theirs[fp.feature].id_transformation
            assert (fp.sample_offset, fp.col_offset, fp.col_shift) == (t.row_offset, t.col_offset, t.col_shift)
    assert [f.name for f in plan.features] == [f.name for f in features]  # the given order stays


def test_stacked_weights_equal_jax_tpu_embedding_for_shuffled_tables():
    """Stacked tables are interchangeable with a JAX user's: same physical rows for a model given
    in reverse name order (tables and features)."""
    import jax.numpy as jnp

    topology = SparseCoreTopology("v5p", 2)
    tables = [TableSpec("zz", 300, 8), TableSpec("mm", 97, 5), TableSpec("aa", 50, 8)]
    features = [FeatureSpec("f_z", "zz", 16), FeatureSpec("f_m", "mm", 16), FeatureSpec("f_a2", "aa", 16),
                FeatureSpec("f_a", "aa", 32)]
    plan = plan_stacking(tables, features, topology)
    theirs = _their_features(tables, features)
    table_stacking.auto_stack_tables(theirs, global_device_count=2, num_sc_per_device=4)
    (stack,) = plan.stacks
    assert [t.table for t in stack.tables] == ["aa", "mm", "zz"]
    weights = {t.name: t.init_weights(seed=1) for t in tables}
    ours = stack_rows(stack, weights, fill=float("nan")).numpy()
    stacked = table_stacking.stack_and_shard_tables(
        {f.table_spec.name: f.table_spec for f in theirs.values()},
        {k: jnp.asarray(v.numpy()) for k, v in weights.items()}, topology.num_sparsecores)
    np.testing.assert_array_equal(np.asarray(stacked[stack.name]).reshape(ours.shape), ours)
