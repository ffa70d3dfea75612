"""Minibatching: the layout equals jax-tpu-embedding's own host code; k passes equal one pass."""

import numpy as np
import pytest

from sparsecore.csr_format import row_pointers_per_sc
from sparsecore.highway_hash import highway_hash_int32
from sparsecore.limits import PartitionOverflowError
from sparsecore.minibatching import (
    MAX_MINIBATCHES,
    jte_buffers,
    minibatch_of_bucket,
    pass_bucket,
    preprocess_minibatched,
    split_of,
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
def test_layout_equals_jax_tpu_embedding_s_minibatching(generation, chips, max_ids, max_unique, combiner):
    embedding = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding", exc_type=ImportError)
    from sparsecore.jte_interop import jte_feature_specs, jte_inputs

    plan = _plan(SparseCoreTopology(generation, chips), max_ids, max_unique, combiner=combiner)
    devices, s = plan.topology.num_devices, plan.topology.sparsecores_per_device
    ks = set()
    for seed in range(3):
        kjt = random_kjt(plan, seed, max_hot=14, id_range=None if seed == 0 else 300)
        inputs = feature_inputs(kjt, plan.features, plan.tables)
        ours = preprocess_minibatched(inputs, plan)
        pre, stats = embedding.preprocess_sparse_dense_matmul_input(
            *jte_inputs(inputs, plan), jte_feature_specs(plan), local_device_count=devices,
            global_device_count=devices, num_sc_per_device=s, enable_minibatching=True)
        theirs = pre.sparse_dense_matmul_input
        k = int(pre.num_minibatches[0])
        for stack in plan.stacks:
            mb = ours[stack.name]
            assert mb.num_minibatches == k
            csr = jte_buffers(stack, mb.entries, devices, s)
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


def test_each_pass_fits_the_limits_and_k_is_bucketed():
    plan = _plan(SparseCoreTopology("v5p", 1), max_ids=16)
    kjt = random_kjt(plan, 1, max_hot=14, id_range=300)
    batches = preprocess_minibatched(feature_inputs(kjt, plan.features, plan.tables), plan)
    for stack in plan.stacks:
        mb = batches[stack.name]
        assert mb.num_minibatches > 1 and len(mb.passes) == pass_bucket(mb.num_minibatches)
        assert len(mb.passes) & (len(mb.passes) - 1) == 0
        n = stack.num_sparsecores
        for csr in mb.passes:
            ends = csr.row_pointers.reshape(-1, row_pointers_per_sc(stack))[:, :n]
            starts = np.concatenate([np.zeros((ends.shape[0], 1), np.int64), -(-ends[:, :-1] // 8) * 8], axis=1)
            assert (ends - starts).max() <= stack.max_ids_per_partition


def test_one_hot_row_over_the_limit_cannot_be_split():
    """A row in more samples of one source SparseCore than max_ids: its ids share a bucket."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    plan = plan_stacking([TableSpec("t", 640, 8, max_ids_per_partition=8, max_unique_ids_per_partition=8)],
                         [FeatureSpec("f", "t", 64)], SparseCoreTopology("v5p", 1))
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.full((64,), 7), lengths=torch.ones(64, dtype=torch.int32))
    with pytest.raises(PartitionOverflowError, match=r"16 ids in one minibatch > max_ids_per_partition 8 .*64 buckets"):
        preprocess_minibatched(feature_inputs(kjt, plan.features, plan.tables), plan)
