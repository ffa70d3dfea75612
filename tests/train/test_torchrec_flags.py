"""TorchRec dlrm_main / MLPerf DLRM flags of `train`: aliases, per-feature table sizes, batch
limits, batch shuffling, TorchRec's preprocessed npy Criteo (against TorchRec's own reader) and
MLPerf multi-hot inputs."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from pipelines.npy_criteo import NpyCriteoReader, npy_days, rank_spans
from pipelines.parquet_reader import ParquetBatchReader
from pipelines.schema import CRITEO
from pipelines.synthetic import SyntheticConfig, generate
from tests.train.conftest import tiny_config
from torchrec_tpu.train.config import ConfigError, TrainConfig, add_config_arguments, config_from_args, load_yaml
from torchrec_tpu.train.data import open_data
from torchrec_tpu.train.distributed import DistEnv
from torchrec_tpu.train.streams import LimitedBatches, MultiHotBatches, ShuffledBatches

NUM_SPARSE = len(CRITEO.sparse)


def _config(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_torchrec_spellings_set_our_options(tmp_path) -> None:
    assert _config("--validation-freq", "7").loop.eval_every == 7
    both = _config("--learning-rate", "0.3")
    assert (both.optim.sparse_lr, both.optim.dense_lr) == (0.3, 0.3)
    later = _config("--learning-rate", "0.3", "--dense-lr", "0.1")
    assert (later.optim.sparse_lr, later.optim.dense_lr) == (0.3, 0.1)
    yaml = tmp_path / "c.yaml"
    yaml.write_text("learning-rate: 0.2\nvalidation_freq: 3\nmulti_hot_sizes: [2, 3]\n")
    assert load_yaml(yaml) == {"sparse_lr": 0.2, "dense_lr": 0.2, "eval_every": 3, "multi_hot_sizes": "2,3",
                               "sparse_optimizer": "sgd", "dense_optimizer": "sgd"}  # dlrm_main: SGD without --adagrad


def test_per_feature_lists_are_checked() -> None:
    sizes = ",".join(str(10 + i) for i in range(NUM_SPARSE))
    given = TrainConfig.from_options(num_embeddings_per_feature=sizes)
    assert given.per_feature("num_embeddings_per_feature", NUM_SPARSE) == tuple(10 + i for i in range(NUM_SPARSE))
    assert TrainConfig.from_options(multi_hot_sizes="3").per_feature("multi_hot_sizes", NUM_SPARSE) == (3,) * NUM_SPARSE
    with pytest.raises(ConfigError, match="has 2 values; the data has 26"):
        TrainConfig.from_options(num_embeddings_per_feature="5,6").per_feature("num_embeddings_per_feature", NUM_SPARSE)
    with pytest.raises(ConfigError, match="--multi-hot-sizes='2,x'"):
        TrainConfig.from_options(multi_hot_sizes="2,x")
    with pytest.raises(ConfigError, match="--mmap-mode needs"):
        TrainConfig.from_options(mmap_mode=True)


def test_num_embeddings_per_feature_sizes_the_tables(tiny_dataset, tmp_path) -> None:
    sizes = tuple(7 + i for i in range(NUM_SPARSE))
    config = tiny_config(tiny_dataset, tmp_path, num_embeddings_per_feature=",".join(map(str, sizes)))
    with open_data(config, DistEnv(0, 1, 1)) as data:
        assert data.table_sizes == sizes
        kjt = next(iter(data.train)).sparse_features
        for key, size in zip(CRITEO.sparse, sizes):
            assert int(kjt[key].values().max()) < size


def _reader(dataset, batch_size=256) -> ParquetBatchReader:
    return ParquetBatchReader(sorted(dataset.glob("*.parquet"))[:2], batch_size, (500,) * NUM_SPARSE,
                              prefetch_row_groups=0)


def _key(batch) -> bytes:
    return batch.dense_features.numpy().tobytes()


def test_shuffled_batches_permute_each_epoch_and_resume(tiny_dataset) -> None:
    plain = [_key(b) for b in _reader(tiny_dataset)]
    shuffled = ShuffledBatches(_reader(tiny_dataset), seed=5)
    epoch0, epoch1 = [_key(b) for b in shuffled], [_key(b) for b in shuffled]
    assert sorted(epoch0) == sorted(plain) == sorted(epoch1)
    assert epoch0 != plain and epoch1 != epoch0
    again = ShuffledBatches(_reader(tiny_dataset), seed=5, epoch=1)  # a resumed run in epoch 1
    assert [_key(b) for b in again.iter_from_row(3 * 256)] == epoch1[3:]


def test_limited_batches_stop_after_n_and_resume() -> None:
    batches = LimitedBatches([torch.full((4,), i) for i in range(10)], 3, local_batch=4)
    assert len(batches) == 3 and [int(b[0]) for b in batches] == [0, 1, 2]


def test_limits_bound_each_epoch_and_the_evaluation(tiny_dataset, tmp_path) -> None:
    from torchrec_tpu.train.job import run_job

    config = tiny_config(tiny_dataset, tmp_path / "run", limit_train_batches=3, limit_val_batches=1, epochs=2,
                         log_every=1, shuffle_batches=True)
    summary = run_job(config)
    assert summary.result.steps == 6
    assert summary.result.eval.samples == config.data.eval_batch_size


def _write_npy_days(directory, days=3, rows=300, seed=0) -> None:
    rng = np.random.default_rng(seed)
    for day in range(days):
        np.save(directory / f"day_{day}_dense.npy", np.log(rng.integers(1, 1000, (rows, 13)) + 2).astype(np.float32))
        np.save(directory / f"day_{day}_sparse.npy", rng.integers(0, 2**31 - 1, (rows, NUM_SPARSE)).astype(np.int64))
        np.save(directory / f"day_{day}_labels.npy", rng.integers(0, 2, (rows, 1)).astype(np.int32))


@pytest.mark.parametrize("mmap_mode", [False, True])
def test_npy_reader_matches_torchrecs_in_memory_binary_criteo(tmp_path, mmap_mode) -> None:
    from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, InMemoryBinaryCriteoIterDataPipe

    _write_npy_days(tmp_path)
    sizes = [97 + i for i in range(NUM_SPARSE)]
    assert npy_days(tmp_path) == [0, 1, 2]
    paths = {part: [str(tmp_path / f"day_{d}_{part}.npy") for d in (0, 1)] for part in ("dense", "sparse", "labels")}
    for rank, world_size, drop_last in ((0, 1, False), (0, 2, True), (1, 2, True), (0, 2, False), (1, 2, False)):
        ours = list(NpyCriteoReader(tmp_path, [0, 1], 64, sizes, rank, world_size, drop_last, mmap_mode))
        theirs = list(InMemoryBinaryCriteoIterDataPipe(
            "train", paths["dense"], paths["sparse"], paths["labels"], batch_size=64, rank=rank,
            world_size=world_size, drop_last=drop_last, mmap_mode=mmap_mode, hashes=sizes))
        assert len(ours) == len(theirs) == (600 // 64 // world_size if drop_last else -(-600 // 64 // world_size))
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.dense_features, b.dense_features)
            torch.testing.assert_close(a.labels, b.labels.float())
            for key, theirs_key in zip(CRITEO.sparse, DEFAULT_CAT_NAMES, strict=True):
                assert torch.equal(a.sparse_features[key].values(), b.sparse_features[theirs_key].values().long())
                assert torch.equal(a.sparse_features[key].lengths(), b.sparse_features[theirs_key].lengths().int())


def test_npy_rows_after_the_last_round_are_all_dealt_without_drop_last() -> None:
    # 5 rows in batches of 2 over 2 ranks: one full round, then 1 row for rank 0 and none for rank 1
    assert [rank_spans(5, 2, rank, 2, drop_last=False) for rank in (0, 1)] == [[(0, 2), (4, 5)], [(2, 4)]]


def test_train_on_npy_criteo_holds_out_the_last_day(tmp_path) -> None:
    from torchrec_tpu.train.job import run_job

    (tmp_path / "npy").mkdir()
    _write_npy_days(tmp_path / "npy")
    config = TrainConfig.from_options(in_memory_binary_criteo_path=str(tmp_path / "npy"), mmap_mode=True,
                                      engine="torchrec", num_embeddings=101, embedding_dim=8, dense_arch="16,8",
                                      over_arch="16,1", batch_size=100, eval_batch_size=100,
                                      log_dir=str(tmp_path / "run"), progress=False)
    summary = run_job(config)
    assert summary.result.steps == 6  # days 0 and 1: 600 rows in batches of 100
    assert summary.result.eval.samples == 300  # day 2
    with pytest.raises(ConfigError, match="has 3 day"):
        with open_data(TrainConfig.from_options(in_memory_binary_criteo_path=str(tmp_path / "npy"), eval_files=3),
                       DistEnv(0, 1, 1)):
            pass


def test_multi_hot_expansion_keeps_the_id_and_adds_fixed_offsets(tiny_dataset) -> None:
    sizes = [1 + i % 4 for i in range(NUM_SPARSE)]
    reader = _reader(tiny_dataset, batch_size=32)
    expanded = MultiHotBatches(reader, sizes, (500,) * NUM_SPARSE, seed=1)
    batch, again = next(iter(expanded)), next(iter(MultiHotBatches(reader, sizes, (500,) * NUM_SPARSE, seed=1)))
    original = next(iter(reader)).sparse_features
    for key, k in zip(CRITEO.sparse, sizes):
        ids, lengths = batch.sparse_features[key].values(), batch.sparse_features[key].lengths()
        assert torch.equal(lengths, original[key].lengths() * k)
        assert torch.equal(ids.view(-1, k)[:, 0], original[key].values())  # the id itself first
        assert int(ids.max()) < 500
        assert torch.equal(ids, again.sparse_features[key].values())  # fixed offsets
        if k > 1:  # the same id always expands the same way
            rows = ids.view(-1, k)
            first = {}
            for row in rows.tolist():
                assert first.setdefault(row[0], row) == row


@pytest.mark.parametrize("engine", ["torchrec", "sparsecore"])
def test_multi_hot_training_on_generated_multi_hot_data(tmp_path, engine) -> None:
    from torchrec_tpu.train.job import run_job

    sizes = tuple(1 + i % 3 for i in range(NUM_SPARSE))
    data = tmp_path / "data"
    generate(SyntheticConfig(num_rows=2048, seed=4, max_cardinality=200, rows_per_file=1024, row_group_size=512,
                             multi_hot_sizes=sizes), data, progress=False)
    kjt = next(iter(ParquetBatchReader(sorted(data.glob("*.parquet")), 64, (200,) * NUM_SPARSE))).sparse_features
    for key, k in zip(CRITEO.sparse, sizes):
        assert set(kjt[key].lengths().tolist()) <= {0, k}  # exactly k ids, or missing
    config = TrainConfig.from_options(data=str(data), engine=engine, num_embeddings=200, embedding_dim=8,
                                      dense_arch="16,8", over_arch="16,1", batch_size=128, eval_batch_size=256,
                                      multi_hot_sizes="2", log_dir=str(tmp_path / "run"), progress=False)
    summary = run_job(config)
    assert summary.result.steps == 8 and summary.result.eval.samples == 1024



def test_shuffled_limited_multi_hot_run_resumes_to_the_uninterrupted_weights(tiny_dataset, tmp_path) -> None:
    from tests.train.conftest import flat_checkpoint
    from torchrec_tpu.train.job import run_job

    options = dict(shuffle_batches=True, limit_train_batches=10, multi_hot_sizes="2", epochs=2, log_every=2)
    full = run_job(tiny_config(tiny_dataset, tmp_path / "full", **options))
    first = run_job(tiny_config(tiny_dataset, tmp_path / "first", max_steps=14, **options))  # 4 into epoch 1
    resumed = run_job(tiny_config(tiny_dataset, tmp_path / "resumed", resume=str(first.checkpoint_dir), **options))
    assert full.result.steps == resumed.result.steps == 20
    weights = {name: flat_checkpoint(run.checkpoint_dir, tmp_path / f"{name}.pt")
               for name, run in (("full", full), ("resumed", resumed))}
    for key, value in weights["full"].items():
        if key.startswith("model.") and isinstance(value, torch.Tensor):
            torch.testing.assert_close(weights["resumed"][key], value, rtol=0, atol=0, msg=key)
    with pytest.raises(Exception, match="--shuffle-batches is True in the checkpoint, False now"):
        run_job(tiny_config(tiny_dataset, tmp_path / "changed", resume=str(first.checkpoint_dir),
                            **{**options, "shuffle_batches": False}))
