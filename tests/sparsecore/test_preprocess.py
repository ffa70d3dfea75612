"""Host preprocessing vs jax-tpu-embedding's C++ preprocessing, byte for byte."""

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.limits import PartitionOverflowError
from sparsecore.preprocess import PADDING_ID, preprocess
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking

from .helpers import random_kjt
from .jte_check import assert_same_as_jte


def _plan(topology, combiner="sum", max_ids=256, batch=32):
    limits = dict(max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_ids)
    tables = [TableSpec("ta", 300, 8, combiner, **limits), TableSpec("tb", 97, 5, combiner, **limits),
              TableSpec("tc", 50, 16, combiner, **limits)]
    features = [FeatureSpec("fa", "ta", batch), FeatureSpec("fb", "tb", batch, weighted=True),
                FeatureSpec("fa2", "ta", batch, weighted=True), FeatureSpec("fc", "tc", batch)]
    return plan_stacking(tables, features, topology)


def test_hand_computed_layout():
    """One v5p chip (4 SCs), sum combiner: sample 0 has id 5 twice (merged) and id 9."""
    plan = plan_stacking([TableSpec("t", 64, 8)], [FeatureSpec("f", "t", 4, weighted=True)],
                         SparseCoreTopology("v5p", 1))
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([5, 9, 5, 4, 6]), lengths=torch.tensor([3, 1, 0, 1]),
                            weights=torch.tensor([1.0, 2.0, 0.5, 3.0, 4.0]))
    csr = preprocess(kjt, plan).stacks["t"]
    region = csr.embedding_ids.size // 4
    # SC0 serves sample 0: ids 5, 9 -> destination SC 1, rows 1 and 2; 5 merged with gain 1.5
    np.testing.assert_array_equal(csr.row_pointers[:8], [0, 2, 8, 8, 8, 8, 8, 8])
    np.testing.assert_array_equal(csr.embedding_ids[:10], [1, 2] + [PADDING_ID] * 6 + [PADDING_ID] * 2)
    np.testing.assert_array_equal(csr.gains[:2], [1.5, 2.0])
    assert np.isnan(csr.gains[2:8]).all()
    # SC1 serves sample 1: id 4 -> SC 0, row 1, gain 3; SC3 serves sample 3: id 6 -> SC 2 row 1
    np.testing.assert_array_equal(csr.row_pointers[8:12], [1, 8, 8, 8])
    assert (csr.embedding_ids[region], csr.sample_ids[region], csr.gains[region]) == (1, 0, 3.0)
    np.testing.assert_array_equal(csr.row_pointers[24:28], [0, 0, 1, 8])
    np.testing.assert_array_equal(csr.stats.max_ids_per_partition, [1, 2, 1, 0])
    np.testing.assert_array_equal(csr.stats.required_buffer_size_per_sc, [8, 8, 0, 8])



@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("generation, chips", [("v5p", 1), ("v5p", 2), ("v6e", 4), ("tpu7x", 1)])
def test_randomized_inputs_match_jax_tpu_embedding(combiner, generation, chips):
    plan = _plan(SparseCoreTopology(generation, chips), combiner, batch=64)
    for seed in range(3):
        # seed 0: wide ids; seeds 1, 2: ids below 20 so one sample often repeats an id 3+ times
        assert_same_as_jte(plan, random_kjt(plan, seed, max_hot=12, id_range=None if seed == 0 else 20))


@pytest.mark.parametrize("max_ids", [4, 8])
def test_drop_policy_matches_jax_tpu_embedding(max_ids):
    plan = _plan(SparseCoreTopology("v5p", 2), "mean", max_ids=max_ids, batch=64)
    for seed in range(3):
        kjt = random_kjt(plan, seed, max_hot=10, id_range=None if seed == 0 else 40)
        ours = assert_same_as_jte(plan, kjt, overflow="drop")
        assert sum(s.dropped_ids for s in ours.stats.values()) > 0
        with pytest.raises(PartitionOverflowError, match="max_(unique_)?ids_per_partition"):
            preprocess(kjt, plan)


def test_real_criteo_sample_matches_jax_tpu_embedding(criteo_kjt):
    kjt, plan = criteo_kjt
    assert_same_as_jte(plan, kjt)


def test_large_topology_matches_jax_tpu_embedding():
    plan = _plan(SparseCoreTopology("v5p", 16), "sqrtn", batch=2048)  # 64 SparseCores
    assert_same_as_jte(plan, random_kjt(plan, seed=3, max_hot=16, id_range=200))


@pytest.mark.parametrize("engine", ["numpy", "compiled"])
def test_float_ids_must_be_integral(engine):
    """1.5 used to become id 1; integral float ids give the integer ids' bytes."""
    plan = plan_stacking([TableSpec("t", 64, 8)], [FeatureSpec("f", "t", 4)], SparseCoreTopology("v5p", 1))
    lengths = torch.tensor([2, 1, 0, 1])
    ints = preprocess(KeyedJaggedTensor(keys=["f"], values=torch.tensor([5, 9, 4, 6]), lengths=lengths), plan,
                      engine=engine).stacks["t"]
    floats = preprocess(KeyedJaggedTensor(keys=["f"], values=torch.tensor([5.0, 9.0, 4.0, 6.0]), lengths=lengths),
                        plan, engine=engine).stacks["t"]
    for a, b in zip((ints.row_pointers, ints.embedding_ids, ints.sample_ids), (floats.row_pointers,
                                                                                 floats.embedding_ids,
                                                                                 floats.sample_ids)):
        np.testing.assert_array_equal(a, b)
    for bad, problem in ((1.5, "1.5 is not an integer"), (float("nan"), "nan is not an integer"),
                         (float("inf"), "inf is not an integer"), (2.0**60, "1.15292.* is outside"),
                         (64.0, "64 is outside"), (-1.0, "-1 is outside")):
        kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([5.0, 9.0, bad, 6.0], dtype=torch.float64),
                                lengths=lengths)
        with pytest.raises(ValueError, match=rf"feature 'f' \(table 't'\): id {problem}(?=.*position 2)(?=.*64 rows)"):
            preprocess(kjt, plan, engine=engine)


def test_feature_inputs_of_both_engines_refuse_float_ids():
    from sparsecore.validation import FeatureInput

    with pytest.raises(ValueError, match="FeatureInput ids must be an integer array, got dtype float64"):
        FeatureInput(np.array([1.5, 2.0]), np.array([2]), np.ones(2, np.float32))
