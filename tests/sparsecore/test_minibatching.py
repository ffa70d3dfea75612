"""Minibatching: the layout equals jax-tpu-embedding's own host code (both engines); the xla backend under
"minibatch" equals large limits (the ops backend's: tests/sharding/test_ops_minibatching.py)."""

import numpy as np
import pytest

from sparsecore import native
from sparsecore.csr_format import row_pointers_per_sc
from sparsecore.highway_hash import highway_hash, highway_hash_int32
from sparsecore.limits import PartitionOverflowError
from sparsecore.minibatching import (
    BUCKET_HASH_KEY,
    MAX_MINIBATCHES,
    bucket_of,
    jte_buffers,
    known_bucket_of,
    minibatch_entries,
    minibatch_of_bucket,
    op_buffers,
    pass_bucket,
    split_of,
    stable_order,
)
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs

from .helpers import random_kjt


def _plan(topology, max_ids=16, max_unique=None, batch=64, combiner="sum"):
    limits = dict(max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_unique or max_ids)
    tables = [TableSpec("ta", 3000, 8, combiner, **limits), TableSpec("tb", 970, 8, combiner, **limits)]
    features = [FeatureSpec("fa", "ta", batch), FeatureSpec("fb", "tb", batch, weighted=True),
                FeatureSpec("fa2", "ta", batch, weighted=True)]
    return plan_stacking(tables, features, topology, stack_to_max_ids_per_partition=lambda *_: max_ids,
                         stack_to_max_unique_ids_per_partition=lambda *_: max_unique or max_ids)


def test_highway_hash_matches_the_published_test_vector():
    """HighwayHash's reference vector for the 4 bytes 00 01 02 03 under key 00 01 .. 1f."""
    key = (0x0706050403020100, 0x0F0E0D0C0B0A0908, 0x1716151413121110, 0x1F1E1D1C1B1A1918)
    assert int(highway_hash_int32(np.array([0x03020100]), key)[0]) == 0xF205A46893007EDA


def test_compiled_highway_hash_equals_numpy_s():
    """The extension's HighwayHash (minibatching's hot path) against the numpy reference, over
    the whole int32 range, and the buckets remembered per id against fresh hashes."""
    if native.extension() is None:
        pytest.skip("the compiled extension does not build here")
    values = np.concatenate([np.random.default_rng(0).integers(-2**31, 2**31, 20_000), [0, -1, 2**31 - 1, -2**31]])
    np.testing.assert_array_equal(highway_hash(values, BUCKET_HASH_KEY), highway_hash_int32(values, BUCKET_HASH_KEY))
    ids = np.random.default_rng(1).integers(0, 5000, 3000)
    for _ in range(2):  # the second call reads the memo
        np.testing.assert_array_equal(known_bucket_of(ids), bucket_of(ids))


def test_stable_order_equals_numpy_s_stable_argsort():
    rng = np.random.default_rng(2)
    for bound in (1, 7, 2**16, 2**16 + 1, 2**40):
        keys = rng.integers(0, bound, 4000)
        np.testing.assert_array_equal(stable_order(keys, bound), np.argsort(keys, kind="stable"))


def test_split_tree_of_jax_tpu_embedding_s_example():
    """jax-tpu-embedding's documented example (8 buckets, limit 7) scaled into 64 buckets: the
    pairs fit, the quads and above split."""
    counts = np.zeros(MAX_MINIBATCHES, dtype=np.int64)
    counts[:8] = [2, 5, 1, 6, 3, 4, 2, 0]
    split = split_of(counts, 7)
    minibatch = minibatch_of_bucket(split)
    # buckets {0,1} {2,3} {4,5} {6,7} are minibatches 0..3 (by hand: each pair sums to <= 7)
    np.testing.assert_array_equal(minibatch[:8], [0, 0, 1, 1, 2, 2, 3, 3])
    assert minibatch[8:].max() == 3 and split.bit_count() + 1 == 4


@pytest.mark.parametrize("generation, chips, max_ids, max_unique", [
    ("v5p", 1, 16, 16), ("v5p", 2, 8, 8), ("v6e", 1, 24, 16), ("tpu7x", 1, 16, 12)])
@pytest.mark.parametrize("combiner", ["sum", "sqrtn"])
@pytest.mark.parametrize("engine", ["numpy", "compiled"])
def test_layout_equals_jax_tpu_embedding_s_minibatching(generation, chips, max_ids, max_unique, combiner, engine):
    embedding = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding", exc_type=ImportError)
    if engine == "compiled" and native.extension() is None:
        pytest.skip("the compiled extension does not build here")
    from sparsecore.jte_interop import jte_feature_specs, jte_inputs

    plan = _plan(SparseCoreTopology(generation, chips), max_ids, max_unique, combiner=combiner)
    devices, s = plan.topology.num_devices, plan.topology.sparsecores_per_device
    ks = set()
    for seed in range(3):
        kjt = random_kjt(plan, seed, max_hot=14, id_range=None if seed == 0 else 300)
        inputs = feature_inputs(kjt, plan.features, plan.tables)
        ours = {stack.name: minibatch_entries(stack, inputs, devices, s, engine=engine) for stack in plan.stacks}
        pre, stats = embedding.preprocess_sparse_dense_matmul_input(
            *jte_inputs(inputs, plan), jte_feature_specs(plan), local_device_count=devices,
            global_device_count=devices, num_sc_per_device=s, enable_minibatching=True)
        theirs = pre.sparse_dense_matmul_input
        k = int(pre.num_minibatches[0])
        for stack in plan.stacks:
            mb = ours[stack.name]
            assert mb.num_minibatches == k
            csr = jte_buffers(stack, mb, devices, s)
            width = row_pointers_per_sc(stack)
            pointers = np.asarray(theirs.lhs_row_pointers[stack.name]).reshape(devices, -1)
            ids = np.asarray(theirs.lhs_embedding_ids[stack.name]).reshape(devices, -1)
            ours_pointers = csr.row_pointers.reshape(devices, -1)
            assert ours_pointers.shape == pointers.shape and csr.embedding_ids.size == ids.size
            np.testing.assert_array_equal(ours_pointers[:, :s * k * width], pointers[:, :s * k * width])
            for d in range(devices):
                used = slice(0, int(pointers[d, s * k * width - 1]))  # past it: left uninitialised there
                for ours_array, theirs_array in ((csr.embedding_ids, ids), (csr.sample_ids, theirs.lhs_sample_ids),
                                                 (csr.gains, theirs.lhs_gains)):
                    assert ours_array.reshape(devices, -1)[d, used].tobytes() == \
                        np.asarray(theirs_array if theirs_array is ids else theirs_array[stack.name]).reshape(
                            devices, -1)[d, used].tobytes()
            np.testing.assert_array_equal(mb.stats.max_ids_per_partition, stats.max_ids_per_partition[stack.name])
            np.testing.assert_array_equal(mb.stats.max_unique_ids_per_partition,
                                          stats.max_unique_ids_per_partition[stack.name])
            assert stats.id_drop_counters[stack.name] == 0
        ks.add(k)
    assert max(ks) > 1  # the configs overflow: the comparison covers real splits


def test_each_minibatch_fits_the_limits_and_the_ops_get_a_power_of_two_of_slots():
    plan = _plan(SparseCoreTopology("v5p", 1), max_ids=16)
    inputs = feature_inputs(random_kjt(plan, 1, max_hot=14, id_range=300), plan.features, plan.tables)
    for stack in plan.stacks:
        entries = minibatch_entries(stack, inputs, 1, 4)
        k, n = entries.num_minibatches, stack.num_sparsecores
        key = (entries.chunk * n + entries.dest) * k + entries.minibatch
        first = np.ones(key.size, dtype=bool)
        first[1:] = (key[1:] != key[:-1]) | (entries.row[1:] != entries.row[:-1])
        assert k > 1 and np.bincount(key).max() <= stack.max_ids_per_partition
        assert np.bincount(key[first]).max() <= stack.max_unique_ids_per_partition
        slots = pass_bucket(k)
        assert slots & (slots - 1) == 0 and slots >= k
        assert op_buffers(stack, entries, 1, 4).row_pointers.size == 4 * slots * row_pointers_per_sc(stack)


def test_one_hot_row_over_the_limit_cannot_be_split():
    """A row in more samples of one source SparseCore than max_ids: its ids share a bucket."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from sparsecore.preprocess import preprocess_row_ordered

    plan = plan_stacking([TableSpec("t", 640, 8, max_ids_per_partition=8, max_unique_ids_per_partition=8)],
                         [FeatureSpec("f", "t", 64)], SparseCoreTopology("v5p", 1))
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.full((64,), 7), lengths=torch.ones(64, dtype=torch.int32))
    inputs = feature_inputs(kjt, plan.features, plan.tables)
    message = r"16 ids in one minibatch > max_ids_per_partition 8 .*64 buckets"
    with pytest.raises(PartitionOverflowError, match=message):
        minibatch_entries(plan.stacks[0], inputs, 1, 4)
    for engine in ("numpy", "compiled") if native.extension() else ("numpy",):  # the xla backend's check
        with pytest.raises(PartitionOverflowError, match=message):
            preprocess_row_ordered(inputs, plan, overflow="minibatch", engine=engine)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_xla_backend_minibatch_policy_equals_large_limits(optimizer):
    """The xla backend under overflow="minibatch": 0 ids dropped, forward and the update equal
    (bit for bit: the same entries) a backend whose limits were large enough; "error" refuses
    the same batch and "drop" loses ids."""
    import torch

    from sparsecore import optimizers as opt
    from sparsecore.backends import make_backend
    from sparsecore.preprocess import preprocess_row_ordered

    spec = opt.SGD(0.1) if optimizer == "sgd" else opt.Adagrad(0.1)
    topology = SparseCoreTopology("v5p", 1)
    small, big = (plan_stacking([TableSpec("ta", 3000, 8, "mean", spec, max_ids_per_partition=m,
                                           max_unique_ids_per_partition=m)],
                                [FeatureSpec("fa", "ta", 64), FeatureSpec("fa2", "ta", 64, weighted=True)], topology,
                                stack_to_max_ids_per_partition=lambda *_: m,
                                stack_to_max_unique_ids_per_partition=lambda *_: m) for m in (16, 1024))
    inputs = feature_inputs(random_kjt(small, 1, max_hot=14, id_range=300), small.features, small.tables)
    with pytest.raises(PartitionOverflowError):
        preprocess_row_ordered(inputs, small, overflow="error")
    assert sum(e.stats.dropped_ids for e in preprocess_row_ordered(inputs, small, overflow="drop").values()) > 0
    backends = [make_backend("xla", small, seed=3, overflow="minibatch"), make_backend("xla", big, seed=3)]
    outs = []
    for backend in backends:
        activations, context = backend.forward(inputs)
        grads = {name: torch.full_like(a, 0.5) + a for name, a in activations.items()}
        backend.backward(context, grads)
        outs.append((activations, backend.table_weights()))
        assert backend.last_stats[small.stacks[0].name].dropped_ids == 0
    for name in outs[0][0]:
        assert torch.equal(outs[0][0][name], outs[1][0][name])
    for name in outs[0][1]:
        assert torch.equal(outs[0][1][name], outs[1][1][name])


def test_one_pass_consumers_refuse_the_minibatch_policy():
    from sparsecore.preprocess import preprocess_inputs

    plan = _plan(SparseCoreTopology("v5p", 1))
    inputs = feature_inputs(random_kjt(plan, 0), plan.features, plan.tables)
    with pytest.raises(ValueError, match=r"overflow policy of one pass of CSR buffers .* must be one of "
                                         r"\('error', 'drop'\), got 'minibatch'"):
        preprocess_inputs(inputs, plan, overflow="minibatch")
