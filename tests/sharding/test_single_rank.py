"""World size 1: the sparsecore EBC equals stock TorchRec EBC + the same optimizer over steps."""

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import FTRL, Adam
from sparsecore.limits import PartitionOverflowError
from torchrec_tpu.sharding import ShardedSparseCoreEBC, TableSharding

from .reference import (
    CONFIGS,
    OPTIMIZERS,
    assert_tables_close,
    random_kjt,
    reference_ebc,
    slice_batch,
    targets,
    train_reference,
    with_last_id,
)
from .single_rank import BATCH, sharded_ebc

STEPS = 4



@pytest.mark.parametrize("optimizer,backend", [("sgd", "xla"), ("adagrad", "xla"), ("rowwise_adagrad", "xla"),
                                               ("adagrad", "fbgemm"), ("sgd", "ops"), ("adagrad", "ops"),
                                               ("rowwise_adagrad", "ops")])
def test_trains_like_stock_torchrec(optimizer, backend):
    expected_outputs, expected_weights = train_reference(optimizer, STEPS, BATCH)
    ebc = sharded_ebc(optimizer, backend)
    for step in range(STEPS):
        pooled = ebc(random_kjt(BATCH, step))
        assert pooled.keys() == ["user", "item", "hist", "small"]
        torch.testing.assert_close(pooled.values(), expected_outputs[step], atol=1e-5, rtol=1e-5)
        (0.5 * ((pooled.values() - targets(BATCH, step)) ** 2).sum()).backward()
    assert_tables_close(ebc.unsharded_weights(), expected_weights)


def test_a_batch_the_sparsecores_cannot_split_is_padded():
    """6 samples over the 4 SparseCores of a v5p chip: TorchRec takes any batch size, so the EBC
    pads with empty samples, directly and through prefetch."""
    batch = 6
    expected_outputs, expected_weights = train_reference("adagrad", STEPS, batch)
    plan = {c.name: TableSharding("table_wise", (0,)) for c in CONFIGS}
    ebc = ShardedSparseCoreEBC.from_torchrec(reference_ebc(), batch, plan, OPTIMIZERS["adagrad"][0])
    assert (ebc.local_batch, ebc.padded_local_batch, ebc.global_batch) == (6, 8, 8)
    assert {f.batch_size for f in ebc.features} == {6}  # the features as given: this rank's batch, kept
    assert {f.batch_size for f in ebc.local_backend.plan.features} == {8}  # the backend's: the padded global batch
    for step in range(STEPS):
        kjt = random_kjt(batch, step)
        pooled = ebc(ebc.prefetch(kjt) if step % 2 else kjt)
        torch.testing.assert_close(pooled.values(), expected_outputs[step], atol=1e-5, rtol=1e-5)
        (0.5 * ((pooled.values() - targets(batch, step)) ** 2).sum()).backward()
    assert_tables_close(ebc.unsharded_weights(), expected_weights)


def test_bad_id_names_the_feature():
    ebc = sharded_ebc("sgd")
    with pytest.raises(ValueError, match=r"feature 'small' \(table 't_small'\): id 9 is outside the table's 9 rows"):
        ebc(with_last_id(random_kjt(BATCH, 0), 9))  # the last id is one of "small" (9 rows)


def test_sharding_errors_name_the_table():
    with pytest.raises(ValueError, match="table 't_item' has no sharding"):
        ShardedSparseCoreEBC.from_torchrec(reference_ebc(), BATCH, {"t_user": TableSharding("table_wise", (0,))},
                                           OPTIMIZERS["sgd"][0])
    with pytest.raises(ValueError, match="sharding type must be one of"):
        TableSharding("diagonal")


def test_other_batch_sizes_are_padded_or_chunked():
    ebc = sharded_ebc("sgd")
    big = random_kjt(2 * BATCH + 5, seed=7)
    with torch.no_grad():
        expected = reference_ebc()(big).values()
        torch.testing.assert_close(ebc(big).values(), expected, atol=1e-6, rtol=1e-6)
        small = slice_batch(big, 0, 5)
        torch.testing.assert_close(ebc(small).values(), expected[:5], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="exceeds the EBC's padded_local_batch 16"):
        ebc(big)


@pytest.mark.parametrize("backend", ["xla", pytest.param("ops", marks=pytest.mark.slow)])
def test_state_dict_round_trip_continues_identically(backend):
    first, second = sharded_ebc("adagrad", backend), sharded_ebc("adagrad", backend)
    for step in range(2):
        out = first(random_kjt(BATCH, step)).values()
        (0.5 * ((out - targets(BATCH, step)) ** 2).sum()).backward()
    second.load_state_dict(first.state_dict())
    for ebc in (first, second):
        out = ebc(random_kjt(BATCH, 5)).values()
        (0.5 * ((out - targets(BATCH, 5)) ** 2).sum()).backward()
    for name, weight in first.unsharded_weights().items():
        assert torch.equal(weight, second.unsharded_weights()[name])
    assert torch.equal(first.unsharded_slots()["t_item"]["accumulator"],
                       second.unsharded_slots()["t_item"]["accumulator"])


def test_unshards_into_a_plain_torchrec_ebc():
    ebc = sharded_ebc("adagrad")
    for step in range(2):
        out = ebc(random_kjt(BATCH, step)).values()
        (0.5 * ((out - targets(BATCH, step)) ** 2).sum()).backward()
    plain = ebc.to_torchrec()
    kjt = random_kjt(BATCH, 9)
    with torch.no_grad():
        torch.testing.assert_close(plain(kjt).values(), ebc(kjt).values(), atol=1e-6, rtol=1e-6)


def test_partition_limits_from_the_configs_replace_the_default():
    """300 distinct ids of one sample in one partition: over the default 256 per partition,
    fine once the table's limits (``SparseCoreEmbeddingConfig``'s, or FDO's) are given."""
    stock = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=4096,
                                                              feature_names=["f"])])
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.arange(300) * 8, lengths=torch.tensor([300, 0, 0, 0]))
    plan = {"t": TableSharding("table_wise", (0,))}
    default = ShardedSparseCoreEBC.from_torchrec(stock, 4, plan, OPTIMIZERS["sgd"][0])
    with pytest.raises(PartitionOverflowError, match="max_ids_per_partition 256"):
        default(kjt)
    raised = ShardedSparseCoreEBC.from_torchrec(stock, 4, plan, OPTIMIZERS["sgd"][0],
                                                partition_limits={"t": (512, 512)})
    with torch.no_grad():
        torch.testing.assert_close(raised(kjt).values(), stock(kjt).values())


@pytest.mark.slow
@pytest.mark.parametrize("spec", [Adam(0.05, beta_1=0.9, beta_2=0.99, epsilon=1e-6),
                                  FTRL(0.1, learning_rate_power=-0.5, l1_regularization_strength=0.01,
                                       l2_regularization_strength=0.001, beta=0.1)], ids=["adam", "ftrl"])
def test_ops_backend_trains_like_the_xla_backend(spec):
    """The optimizers stock TorchRec has no exact twin of (lazy Adam, FTRL): the ops backend's fused
    updates against the xla backend's, with every combiner (sum, mean) and multi-hot ids."""
    plan = {c.name: TableSharding("table_wise", (0,)) for c in CONFIGS}
    ebcs = [ShardedSparseCoreEBC.from_torchrec(reference_ebc(), BATCH, plan, spec, backend=b) for b in ("xla", "ops")]
    for step in range(STEPS):
        outs = [ebc(random_kjt(BATCH, step)).values() for ebc in ebcs]
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        for out in outs:
            (0.5 * ((out - targets(BATCH, step)) ** 2).sum()).backward()
    expected, got = ebcs[0].unsharded_weights(), ebcs[1].unsharded_weights()
    for name, weight in expected.items():
        assert not torch.equal(weight, reference_ebc().embedding_bags[name].weight.detach())  # trained
        torch.testing.assert_close(got[name], weight, atol=1e-5, rtol=1e-5, msg=name)
    expected_slots, got_slots = ebcs[0].unsharded_slots(), ebcs[1].unsharded_slots()
    for table, slots in expected_slots.items():
        for slot, value in slots.items():
            torch.testing.assert_close(got_slots[table][slot], value, atol=1e-5, rtol=1e-4, msg=f"{table}.{slot}")
