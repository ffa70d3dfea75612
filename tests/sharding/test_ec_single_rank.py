"""World size 1: the sharded sparsecore EmbeddingCollection equals stock TorchRec's
EmbeddingCollection + the same optimizer over steps, and reports bad input by name."""

import re

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.specs import FeatureSpec, TableSpec
from torchrec_tpu.sharding import ShardedSparseCoreEC, TableSharding
from torchrec_tpu.sharding.ec import _unique_rows

from .ec_reference import EC_CONFIGS, reference_ec, sequence_loss, train_reference_ec
from .reference import OPTIMIZERS, assert_tables_close, random_kjt, with_last_id

BATCH, STEPS = 6, 3


def sharded(optimizer: str, backend: str = "xla", batch_size: int = BATCH, **kwargs) -> ShardedSparseCoreEC:
    plan = {c.name: TableSharding("table_wise", (0,)) for c in EC_CONFIGS}
    return ShardedSparseCoreEC.from_torchrec(reference_ec(), plan, OPTIMIZERS[optimizer][0], batch_size=batch_size,
                                             backend=backend, **kwargs)


@pytest.mark.parametrize("optimizer,backend", [pytest.param("sgd", "xla", marks=pytest.mark.slow), ("adagrad", "xla"),
                                               ("sgd", "fbgemm"), ("adagrad", "fbgemm")])
def test_trains_like_stock_torchrec(optimizer, backend):
    expected_outputs, expected_weights = train_reference_ec(optimizer, [BATCH] * STEPS)
    ec = sharded(optimizer, backend, batch_size=4 * BATCH)  # room for every step's ids: one xla compile
    for step in range(STEPS):
        kjt = random_kjt(BATCH, step)
        out = ec(kjt)
        assert list(out) == ["user", "item", "hist", "small"]
        for name, jt in out.items():
            torch.testing.assert_close(jt.lengths(), kjt[name].lengths(), rtol=0, atol=0)
            torch.testing.assert_close(jt.values(), expected_outputs[step][name], atol=1e-6, rtol=1e-6)
        sequence_loss(out, step).backward()
    assert_tables_close(ec.unsharded_weights(), expected_weights)


def test_lookup_buffers_grow_mid_training_keeping_tables_and_slots():
    batches = [1, 2, 12]  # more unique ids each step than the buffers sized for batch 1 hold
    expected_outputs, expected_weights = train_reference_ec("adagrad", batches)
    ec = sharded("adagrad", "fbgemm", batch_size=1)
    backends = []
    for step, batch in enumerate(batches):
        out = ec(random_kjt(batch, step))
        backends.append(ec._backend)
        for name, jt in out.items():
            torch.testing.assert_close(jt.values(), expected_outputs[step][name], atol=1e-6, rtol=1e-6)
        sequence_loss(out, step).backward()
    assert backends[2] is not backends[1]  # rebuilt after two updates
    assert_tables_close(ec.unsharded_weights(), expected_weights)


def test_the_features_keep_the_batch_they_were_given():
    """The features hold this rank's batch (``local_batch``) as given; a batch of another size is
    looked up at its own, and features of several sizes (no one KJT has them) are refused."""
    ec = sharded("sgd", batch_size=5)
    assert ec.local_batch == 5 and {f.batch_size for f in ec.features} == {5}
    ec(random_kjt(BATCH, 0))
    assert {f.batch_size for f in ec.features} == {5}
    with pytest.raises(ValueError, match=r"one batch size \(a KJT's samples on this rank\), got \[8, 16\]"):
        ShardedSparseCoreEC([TableSpec("t", 50, 8)], [FeatureSpec("f", "t", 8), FeatureSpec("g", "t", 16)],
                            {"t": TableSharding("table_wise", (0,))})


def test_bad_input_names_the_feature():
    ec = sharded("sgd")
    kjt = random_kjt(BATCH, 0)
    with pytest.raises(ValueError, match=r"feature 'small' \(table 't_small'\): id 9 is outside the table's 9 rows "
                                         r"\[0, 9\)"):
        ec(with_last_id(kjt, 9))  # the last id is one of "small" (9 rows)
    with pytest.raises(ValueError, match=r"the KJT has no feature 'small'; its features are \['user', 'item', 'hist', "
                                         r"'clicks'\]"):
        ec(KeyedJaggedTensor(keys=["user", "item", "hist", "clicks"], values=kjt.values(), lengths=kjt.lengths()))


def test_indices_and_unsharding_into_a_plain_torchrec_ec():
    ec = sharded("adagrad", "fbgemm", need_indices=True)
    for step in range(2):
        sequence_loss(ec(random_kjt(BATCH, step)), step).backward()
    plain = ec.to_torchrec()
    kjt = random_kjt(2 * BATCH + 1, 9)  # any batch size
    with torch.no_grad():
        ours, theirs = ec(kjt), plain(kjt)
    assert plain.need_indices() and list(ours) == list(theirs)
    for name in theirs:
        torch.testing.assert_close(ours[name].values(), theirs[name].values(), atol=0, rtol=0)
        assert torch.equal(ours[name].weights(), theirs[name].weights())
        assert torch.equal(ours[name].offsets(), theirs[name].offsets())


def test_state_dict_round_trip_continues_identically():
    first, second = sharded("adagrad", "fbgemm"), sharded("adagrad", "fbgemm")
    for step in range(2):
        sequence_loss(first(random_kjt(BATCH, step)), step).backward()
    second.load_state_dict(first.state_dict())
    for ec in (first, second):
        sequence_loss(ec(random_kjt(3 * BATCH, 5)), 5).backward()
    for name, weight in first.unsharded_weights().items():
        assert torch.equal(weight, second.unsharded_weights()[name])
    assert torch.equal(first.unsharded_slots()["t_item"]["accumulator"],
                       second.unsharded_slots()["t_item"]["accumulator"])


def test_local_lookup_lowers_to_sparsecore_kernels():
    """The EC's local plan (bags of one id, partition limits sized to its buffers) is a valid
    SparseCore program for the tpu backend (lowered here; it executes only on a TPU)."""
    pytest.importorskip("jax_tpu_embedding")
    from sparsecore.backends.tpu import lowered_programs

    ec = sharded("sgd", "fbgemm")  # (the SparseCore Adagrad kernel has no epsilon)
    ec(random_kjt(BATCH, 0))
    plan = ec._backend.plan
    for stack in plan.stacks:
        forward, backward = lowered_programs(plan, stack.name)
        assert "custom_call @SparseDenseMatmulOp" in forward
        assert "custom_call @SparseDenseMatmulGradOpWithOptimizerUpdate" in backward


@pytest.mark.parametrize("table_rows,ids", [(7, 500), (10_000, 3_000), (10**6, 300), (5, 0)])
def test_input_dist_unique_rows_equal_numpy_unique(table_rows, ids):
    """Both ways of deduplicating a feature's rows (a mark per table row for small tables, a sort
    for large ones) give np.unique's rows and inverse, dtypes included."""
    rows = np.random.default_rng(table_rows).integers(0, table_rows, ids)
    unique, inverse = _unique_rows(rows, table_rows)
    expected_unique, expected_inverse = np.unique(rows, return_inverse=True)
    for got, expected in ((unique, expected_unique), (inverse, expected_inverse)):
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)


def test_managed_collisions_are_refused_by_name():
    """The sequence tables do not remap raw ids: an MC-EC, or zch specs, fail with one clear line
    (not raw ids taken as rows)."""
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule

    from torchrec_tpu.sharding.zch import ZchSpec

    ec = reference_ec()
    mcc = ManagedCollisionCollection(
        {c.name: MCHManagedCollisionModule(zch_size=c.num_embeddings, device=torch.device("cpu"),
                                           eviction_policy=ZchSpec().eviction_policy(), eviction_interval=1)
         for c in EC_CONFIGS}, ec.embedding_configs())
    plan = {c.name: TableSharding("table_wise", (0,)) for c in EC_CONFIGS}
    names = sorted(c.name for c in EC_CONFIGS)
    with pytest.raises(ValueError, match=re.escape(f"a ManagedCollisionEmbeddingCollection (zch tables {names}): "
                                                   "ShardedSparseCoreEC does not remap raw ids")):
        ShardedSparseCoreEC.from_torchrec(ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped_features=False),
                                          plan, OPTIMIZERS["sgd"][0], backend="fbgemm")
    with pytest.raises(ValueError, match=r"zch tables \['t_user'\]: ShardedSparseCoreEC does not remap raw ids"):
        sharded("sgd", "fbgemm").manage_collisions({"t_user": ZchSpec()})
