"""torchrec_tpu.experimental: TorchRec TPU's config / preprocessing / batch API on sparsecore."""

import dataclasses

import numpy as np
import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.limits import PartitionOverflowError
from sparsecore.preprocess import preprocess
from sparsecore.validation import feature_inputs
from torchrec_tpu.experimental import (
    KeyedSparseCorePreprocessedInput,
    SparseCoreBatch,
    SparseCoreEmbeddingConfig,
    SparseCoreInputPreprocessor,
)
from torchrec_tpu.experimental.datasets.fdo.fdo_client import KeyedSparseCoreInputStats, SparseCoreInputStats
from torchrec_tpu.experimental.modules.embedding_configs import sparsecore_specs


def _bag(name, features, vocab=100, dim=8, pooling=PoolingType.SUM, **limits):
    return SparseCoreEmbeddingConfig(
        EmbeddingBagConfig(name=name, num_embeddings=vocab, embedding_dim=dim, feature_names=features,
                           pooling=pooling), **limits)


def _kjt(keys, batch, vocab, max_len=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch,), generator=g)
    values = torch.randint(0, vocab, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


def test_config_wraps_torchrec_configs_and_limits_reach_specs():
    bag = _bag("t", ["f", "g"], pooling=PoolingType.MEAN, max_ids_per_partition=1024,
               max_unique_ids_per_partition=512)
    assert (bag.name, bag.num_embeddings, bag.embedding_dim, bag.feature_names) == ("t", 100, 8, ["f", "g"])
    assert bag.pooling == PoolingType.MEAN and bag.suggested_coo_buffer_size_per_device == 32
    seq = SparseCoreEmbeddingConfig(EmbeddingConfig(name="s", num_embeddings=50, embedding_dim=16,
                                                    feature_names=["h"]), max_seq_len=5)
    assert (seq.max_ids_per_partition, seq.max_unique_ids_per_partition, seq.max_seq_len) == (256, 256, 5)
    with pytest.raises(AttributeError, match="'s'"):
        _ = seq.pooling
    tables, features = sparsecore_specs([bag, seq], 8)
    assert (tables[0].combiner, tables[0].max_ids_per_partition, tables[0].max_unique_ids_per_partition) == \
        ("mean", 1024, 512)
    assert tables[1].max_ids_per_partition == 256
    assert {f.name: f.batch_size for f in features} == {"f": 8, "g": 8, "h": 40}


def test_raised_max_ids_per_partition_is_honoured():
    """300 ids of one sample all go to one partition: over the default 256, fine at 512."""
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.arange(300) * 8, lengths=torch.tensor([300, 0, 0, 0]))
    default = SparseCoreInputPreprocessor([_bag("t", ["f"], vocab=4096)], batch_size=4)
    with pytest.raises(PartitionOverflowError, match=r"'t'.* 300 ids > max_ids_per_partition 256"):
        default(kjt)
    raised = SparseCoreInputPreprocessor(
        [_bag("t", ["f"], vocab=4096, max_ids_per_partition=512, max_unique_ids_per_partition=512)], batch_size=4)
    out = raised(kjt)
    assert out.stats.table_stats["t"] == SparseCoreInputStats(0, 300, 300)
    dropping = SparseCoreInputPreprocessor([_bag("t", ["f"], vocab=4096)], batch_size=4, allow_id_dropping=True)
    assert dropping(kjt).stats.table_stats["t"].dropped_count == 44


def test_stacks_by_stack_table_name_and_matches_sparsecore_preprocess():
    tables = [_bag("ta", ["fa", "fa2"], vocab=300, stack_table_name="big"),
              _bag("tb", ["fb"], vocab=97, dim=5, stack_table_name="big"), _bag("tc", ["fc"], vocab=50, dim=16)]
    pre = SparseCoreInputPreprocessor(tables, batch_size=16, num_sc_per_device=4)
    assert [c.stack_name for c in pre.stacked_configs] == ["big", "tc"]
    big = tables[0].stacked_config
    assert big is tables[1].stacked_config and big.tables == tables[:2]
    assert (big.row_offsets_in_shard, big.shard_rotations, big.padded_vocab_sizes) == \
        ({"ta": 0, "tb": 80}, {"ta": 0, "tb": 0}, {"ta": 320, "tb": 128})
    assert big.total_sample_count_multiplier == 3 and big.get_total_sample_count(16) == 48
    kjt = _kjt(["fc", "fa", "fb", "fa2"], 16, 50, seed=1)
    out = pre(kjt)
    assert isinstance(out, KeyedSparseCorePreprocessedInput) and list(out.table_tensors) == ["big", "tc"]
    reference = preprocess(kjt, pre.plan)
    for name, csr in reference.stacks.items():
        got = out.table_tensors[name]
        for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
            assert getattr(got, field).numpy().tobytes() == getattr(csr, field).tobytes()
        assert got.stats.observed_max_ids == int(csr.stats.max_ids_per_partition.max())


@pytest.mark.parametrize("devices, num_sc", [(1, 2), (2, 2), (2, 4)])
def test_matches_jax_tpu_embedding_for_one_local_device(devices, num_sc):
    """This process's share (one device of ``devices``) equals jax-tpu-embedding's preprocessing
    with local_device_count=1, global_device_count=devices."""
    jte_interop = pytest.importorskip("sparsecore.jte_interop", exc_type=ImportError)
    from jax_tpu_embedding.sparsecore.lib.nn import embedding

    tables = [_bag("ta", ["fa"], vocab=300, pooling=PoolingType.MEAN),
              _bag("tb", ["fb", "fb2"], vocab=97, pooling=PoolingType.MEAN, stack_table_name="s"),
              _bag("tc", ["fc"], vocab=64, pooling=PoolingType.MEAN, stack_table_name="s")]
    pre = SparseCoreInputPreprocessor(tables, batch_size=8, global_device_count=devices, num_sc_per_device=num_sc)
    kjt = _kjt(["fa", "fb", "fb2", "fc"], 8, 64, seed=devices * 10 + num_sc)
    out = pre(kjt)
    local = pre.plan.for_local_devices(1)
    inputs = feature_inputs(kjt, local.features, local.tables)
    ids, weights = jte_interop.jte_inputs(inputs, local)
    theirs, _ = embedding.preprocess_sparse_dense_matmul_input(
        ids, weights, jte_interop.jte_feature_specs(pre.plan), local_device_count=1,
        global_device_count=devices, num_sc_per_device=num_sc)
    theirs = theirs.sparse_dense_matmul_input
    for name, got in out.table_tensors.items():
        pointers = np.asarray(theirs.lhs_row_pointers[name])
        assert got.row_pointers.numpy().tobytes() == pointers.tobytes()
        region = got.embedding_ids.numel() // num_sc
        width = got.row_pointers.numel() // num_sc
        for k in range(num_sc):  # past each SparseCore's last pointer jax-tpu-embedding leaves garbage
            used = slice(k * region, k * region + int(pointers[(k + 1) * width - 1]))
            for field, theirs_field in (("embedding_ids", theirs.lhs_embedding_ids),
                                        ("sample_ids", theirs.lhs_sample_ids), ("gains", theirs.lhs_gains)):
                assert getattr(got, field).numpy()[used].tobytes() == np.asarray(theirs_field[name])[used].tobytes()


def test_sequence_table_gives_each_id_a_row():
    seq = SparseCoreEmbeddingConfig(EmbeddingConfig(name="s", num_embeddings=64, embedding_dim=8,
                                                    feature_names=["h"]), max_seq_len=3)
    pre = SparseCoreInputPreprocessor([seq], batch_size=2)
    kjt = KeyedJaggedTensor(keys=["h"], values=torch.tensor([5, 5, 7]), lengths=torch.tensor([2, 1]))
    out = pre(kjt).table_tensors["s"]
    assert out.actual_num_ids == {"h": 3} and out.lengths["h"].tolist() == [2, 1]
    # rows 0-2 (ids 5, 5, 7) sit on SparseCore 0 and all go to SparseCore 1: the two 5s are
    # different rows, so they stay two entries of one unique id
    assert (out.stats.observed_max_ids, out.stats.observed_max_unique_ids) == (3, 2)
    np.testing.assert_array_equal(sorted(out.sample_ids[out.gains == out.gains].tolist()), [0, 1, 2])
    with pytest.raises(ValueError, match=r"feature 'h' of sequence table 's' has 7 ids > batch_size 2 x "
                                         r"max_seq_len 3 = 6"):
        pre(KeyedJaggedTensor(keys=["h"], values=torch.arange(7), lengths=torch.tensor([4, 3])))
    with pytest.raises(ValueError, match="max_seq_len must be provided for EmbeddingConfig table 'x'"):
        SparseCoreInputPreprocessor([SparseCoreEmbeddingConfig(EmbeddingConfig(
            name="x", num_embeddings=8, embedding_dim=8, feature_names=["y"]))], batch_size=2)


def test_to_cpu_round_trip_and_batch_from_batch():
    pre = SparseCoreInputPreprocessor([_bag("t", ["f", "g"])], batch_size=4)
    kjt = _kjt(["f", "g"], 4, 100)
    out = pre(kjt)
    moved = out.to("cpu")
    for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):  # gains pad with NaN
        assert getattr(moved.table_tensors["t"], field).numpy().tobytes() == \
            getattr(out.table_tensors["t"], field).numpy().tobytes()
    assert moved.stats is out.stats
    batch = Batch(dense_features=torch.randn(4, 13), sparse_features=kjt, labels=torch.rand(4))
    sc = SparseCoreBatch.from_batch(batch, pre)
    assert sc.dense_features is batch.dense_features and sc.labels is batch.labels
    assert torch.equal(sc.sparse_features.table_tensors["t"].embedding_ids, out.table_tensors["t"].embedding_ids)
    on_cpu = sc.to("cpu")
    assert torch.equal(on_cpu.dense_features, batch.dense_features)
    assert isinstance(on_cpu.sparse_features, KeyedSparseCorePreprocessedInput)


def test_bad_input_errors_name_what_is_wrong():
    pre = SparseCoreInputPreprocessor([_bag("t", ["f"], vocab=10)], batch_size=2)
    with pytest.raises(ValueError, match=r"feature 'f'.*12"):
        pre(KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 12]), lengths=torch.tensor([1, 1])))
    with pytest.raises(ValueError, match=r"no feature 'f' \(table 't'\)"):
        pre(KeyedJaggedTensor(keys=["g"], values=torch.tensor([1]), lengths=torch.tensor([1, 0])))
    with pytest.raises(ValueError, match=r"batch_size must be a positive multiple of num_sc_per_device=2.* 3"):
        SparseCoreInputPreprocessor([_bag("t", ["f"])], batch_size=3)
    with pytest.raises(ValueError, match="num_sc_per_device=3"):
        SparseCoreInputPreprocessor([_bag("t", ["f"])], batch_size=6, num_sc_per_device=3)
    with pytest.raises(ValueError, match=r"table 't': max_ids_per_partition must be a positive int, got 0"):
        _bag("t", ["f"], max_ids_per_partition=0)
    with pytest.raises(ValueError, match=r"stack 's': table 'b' has padded dim 16 but table 'a' has 8"):
        SparseCoreInputPreprocessor([_bag("a", ["f"], stack_table_name="s"),
                                     _bag("b", ["g"], dim=16, stack_table_name="s")], batch_size=2)


def test_update_preprocessing_parameters_raises_limits_from_fdo(tmp_path):
    tables = [_bag("t", ["f"], vocab=4096)]
    pre = SparseCoreInputPreprocessor(tables, batch_size=4, allow_id_dropping=True, fdo_dir=tmp_path)
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.arange(300) * 8, lengths=torch.tensor([300, 0, 0, 0]))
    assert pre(kjt).stats.table_stats["t"].dropped_count == 44
    pre.publish_fdo()
    assert pre.fdo_client.load().table_stats["t"] == SparseCoreInputStats(44, 300, 300)
    assert pre.update_preprocessing_parameters()
    assert (tables[0].max_ids_per_partition, tables[0].max_unique_ids_per_partition) == (360, 360)
    assert pre.plan.stacks[0].max_ids_per_partition == 360
    assert pre(kjt).stats.table_stats["t"].dropped_count == 0
    same = KeyedSparseCoreInputStats({"t": SparseCoreInputStats(0, 10, 10)})
    assert not pre.update_preprocessing_parameters(same)
    assert dataclasses.asdict(pre.last_stats.table_stats["t"]) == {
        "dropped_count": 0, "observed_max_ids": 300, "observed_max_unique_ids": 300}


def test_non_integral_float_ids_are_refused_and_weights_dropped_with_one_warning():
    import warnings

    pre = SparseCoreInputPreprocessor([_bag("t", ["f"], vocab=64)], batch_size=4)
    lengths = torch.tensor([2, 1, 0, 1])
    with pytest.raises(ValueError, match=r"feature 'f' \(table 't'\): ids must be integers, got 1.5 at position 1"):
        pre(KeyedJaggedTensor(keys=["f"], values=torch.tensor([5.0, 1.5, 4.0, 6.0]), lengths=lengths))
    plain = pre(KeyedJaggedTensor(keys=["f"], values=torch.tensor([5, 9, 4, 6]), lengths=lengths))
    weighted = KeyedJaggedTensor(keys=["f"], values=torch.tensor([5, 9, 4, 6]), lengths=lengths,
                                 weights=torch.tensor([2.0, 3.0, 4.0, 5.0]))
    with pytest.warns(UserWarning, match="drops the KJT's per-id weights"):
        first = pre(weighted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre(weighted)  # once per preprocessor
    for name, got in first.table_tensors.items():  # as if unweighted: every id counts with weight 1
        want = plain.table_tensors[name]
        for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
            torch.testing.assert_close(getattr(got, field), getattr(want, field), equal_nan=True)
