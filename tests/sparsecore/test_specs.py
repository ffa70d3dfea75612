import pytest
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from sparsecore.optimizers import FTRL, SGD, Adagrad, Adam
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec, validate_specs
from sparsecore.torchrec_convert import configs_from_specs, specs_from_configs


def test_topology_reads_sparsecores_from_hardware_catalog():
    assert SparseCoreTopology("v5p", 2).num_sparsecores == 8
    assert SparseCoreTopology("v6e", 4).num_sparsecores == 8
    tpu7x = SparseCoreTopology("tpu7x", 2)  # two chiplet devices of two SparseCores per chip
    assert (tpu7x.num_devices, tpu7x.sparsecores_per_device, tpu7x.num_sparsecores) == (4, 2, 8)
    assert SparseCoreTopology("v6e", 1).hbm_bytes_per_chip == 32 * 2**30


@pytest.mark.parametrize("kwargs, message", [
    (dict(generation="v9"), "unknown TPU generation"),
    (dict(num_chips=0), "num_chips"),
    (dict(generation="v5p", num_chips=3), "power-of-two"),
])
def test_topology_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseCoreTopology(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=0), "vocab_size"),
    (dict(dim=0), "dim"),
    (dict(combiner="max"), "combiner"),
    (dict(max_ids_per_partition=0), "max_ids_per_partition"),
    (dict(max_ids_per_partition=8, max_unique_ids_per_partition=16), "exceeds"),
])
def test_table_spec_errors_name_the_table(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        TableSpec(**{"name": "t_user", "vocab_size": 10, "dim": 4, **kwargs})
    assert "t_user" in str(info.value)


def test_optimizer_validation():
    with pytest.raises(ValueError, match="learning_rate"):
        SGD(learning_rate=0.0)
    with pytest.raises(ValueError, match="beta_1"):
        Adam(beta_1=1.0)
    with pytest.raises(ValueError, match="0/0"):
        Adagrad(initial_accumulator_value=0.0)
    with pytest.raises(ValueError, match="learning_rate_power"):
        FTRL(learning_rate_power=0.5)


def test_validate_specs_catches_dangling_and_duplicate_names():
    t = TableSpec("t", 10, 4)
    with pytest.raises(ValueError, match="unknown table 'u'"):
        validate_specs([t], [FeatureSpec("f", "u", 8)])
    with pytest.raises(ValueError, match="duplicate feature name 'f'"):
        validate_specs([t], [FeatureSpec("f", "t", 8), FeatureSpec("f", "t", 8)])
    with pytest.raises(ValueError, match="not looked up"):
        validate_specs([t, TableSpec("u", 5, 4)], [FeatureSpec("f", "t", 8)])


def test_init_weights_uses_torchrec_default_bounds_and_distinct_seeds_per_table():
    a, b = TableSpec("a", 400, 8), TableSpec("b", 400, 8)
    wa, wb = a.init_weights(seed=1), b.init_weights(seed=1)
    bound = (1 / 400) ** 0.5
    assert wa.shape == (400, 8) and float(wa.abs().max()) <= bound
    assert float(wa.abs().max()) > 0.9 * bound
    assert not (wa == wb).all()  # stacked tables must not share an RNG stream
    assert (a.init_weights(seed=1) == wa).all()


def test_torchrec_config_round_trip():
    configs = [
        EmbeddingBagConfig(num_embeddings=100, embedding_dim=16, name="t0", feature_names=["f0", "f1"],
                           weight_init_min=-0.1, weight_init_max=0.1),
        EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t1", feature_names=["f2"],
                           pooling=PoolingType.MEAN),
    ]
    tables, features = specs_from_configs(configs, batch_size=32, optimizer=Adagrad(0.05), weighted_features={"f2"})
    assert [(t.name, t.vocab_size, t.dim, t.combiner) for t in tables] == [("t0", 100, 16, "sum"), ("t1", 7, 4, "mean")]
    expected = [("f0", "t0", False), ("f1", "t0", False), ("f2", "t1", True)]
    assert [(f.name, f.table, f.weighted) for f in features] == expected
    assert tables[0].effective_initializer.low == -0.1
    back = configs_from_specs(tables, features)
    for original, converted in zip(configs, back):
        assert (converted.name, converted.num_embeddings, converted.embedding_dim, converted.feature_names,
                converted.pooling) == (original.name, original.num_embeddings, original.embedding_dim,
                                       original.feature_names, original.pooling)
    assert back[1].weight_init_max == pytest.approx((1 / 7) ** 0.5)


def test_torchrec_conversion_errors():
    with pytest.raises(ValueError, match="sqrtn"):
        configs_from_specs([TableSpec("t", 10, 4, "sqrtn")], [FeatureSpec("f", "t", 8)])
    config = EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", feature_names=["f"])
    with pytest.raises(ValueError, match="'g'"):
        specs_from_configs([config], 8, weighted_features={"g"})
