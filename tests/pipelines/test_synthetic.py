import dataclasses

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

import pipelines.synthetic as synthetic
from pipelines.parquet_reader import ParquetBatchReader
from pipelines.synthetic import SyntheticConfig, SyntheticGenerator, default_dataset, generate
from tests.pipelines.conftest import SMALL_CONFIG


def _bytes(directory) -> list[bytes]:
    return [p.read_bytes() for p in sorted(directory.glob("*.parquet"))]


def test_same_seed_byte_identical_other_seed_different(small_dataset, tmp_path):
    generate(SMALL_CONFIG, tmp_path / "again", progress=False)
    assert _bytes(tmp_path / "again") == _bytes(small_dataset)
    generate(dataclasses.replace(SMALL_CONFIG, seed=8), tmp_path / "other", progress=False)
    ours, theirs = pq.read_table(small_dataset), pq.read_table(tmp_path / "other")
    assert ours.num_rows == theirs.num_rows
    assert not ours["C2"].equals(theirs["C2"]) and not ours["I5"].equals(theirs["I5"])


def test_layout_files_row_groups_and_ranges(small_dataset):
    files = sorted(small_dataset.glob("*.parquet"))
    assert [pq.ParquetFile(f).metadata.num_rows for f in files] == [2000, 2000, 1003]
    assert pq.ParquetFile(files[0]).metadata.num_row_groups == 3  # 700 + 700 + 600
    table = pq.read_table(small_dataset)
    assert table.schema == SMALL_CONFIG.schema.arrow_schema()
    for name, size in zip(SMALL_CONFIG.schema.sparse, SMALL_CONFIG.table_sizes):
        ids = pc.list_flatten(table[name]) if SMALL_CONFIG.schema.is_multi_hot(name) else table[name]
        assert pc.min(ids).as_py() >= 0 and pc.max(ids).as_py() < size, name
    lengths = pc.list_value_length(table["C3"]).to_numpy()
    assert lengths.max() <= SMALL_CONFIG.multi_hot_max_length
    assert np.mean(lengths[lengths > 0]) == pytest.approx(SMALL_CONFIG.multi_hot_mean_length, rel=0.1)


def test_missing_rates_match_config(small_dataset):
    table = pq.read_table(small_dataset)
    for name, rate in [("I1", 0.45), ("I12", 0.77), ("C19", 0.44), ("C22", 0.76), ("C1", 0.0)]:
        assert table[name].null_count / table.num_rows == pytest.approx(rate, abs=0.03), name
    assert pc.sum(pc.equal(pc.list_value_length(table["C3"]), 0)).as_py() / table.num_rows == (
        pytest.approx(0.03, abs=0.015)
    )


@pytest.mark.parametrize("exponent", [0.8, 1.2])
def test_id_frequencies_follow_zipf(tmp_path, exponent):
    config = SyntheticConfig(
        num_rows=40_000, max_cardinality=500, zipf_exponent=exponent, row_group_size=10_000
    )
    generate(config, tmp_path, progress=False)
    ids = pq.read_table(tmp_path, columns=["C2"])["C2"].to_numpy()  # C2 is never missing
    observed = np.sort(np.bincount(ids, minlength=500))[::-1][:10] / ids.size
    ranks = np.arange(1, 501, dtype=np.float64)
    expected = (ranks**-exponent / np.sum(ranks**-exponent))[:10]
    np.testing.assert_allclose(observed, expected, rtol=0.12)


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney U / (n_pos * n_neg)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    positives = labels == 1
    n_pos, n_neg = positives.sum(), (~positives).sum()
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _fit_logistic_auc(directory, config: SyntheticConfig) -> float:
    """Logistic regression on the dense features plus one learned bias per (feature, id)."""
    sizes = config.table_sizes
    (batch,) = ParquetBatchReader(directory, config.num_rows, sizes, config.schema)
    per_key = batch.sparse_features.to_dict()
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    # Every id of every feature indexes one shared bias table; sample_of maps it to its row.
    rows = torch.cat([per_key[k].values() + int(offsets[i]) for i, k in enumerate(config.schema.sparse)])
    sample_of = torch.cat(
        [torch.repeat_interleave(torch.arange(config.num_rows), per_key[k].lengths()) for k in per_key]
    )
    bias = torch.zeros(int(sum(sizes)), requires_grad=True)
    linear = torch.nn.Linear(len(config.schema.dense), 1)
    optimizer = torch.optim.Adam([bias, *linear.parameters()], lr=0.05)
    train = int(0.8 * config.num_rows)
    for _ in range(60):
        optimizer.zero_grad()
        logits = linear(batch.dense_features).squeeze(1)
        logits = logits + torch.zeros(config.num_rows).index_add(0, sample_of, bias[rows])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits[:train], batch.labels[:train])
        (loss + 1e-4 * bias.pow(2).sum()).backward()
        optimizer.step()
    return _auc(logits[train:].detach().numpy(), batch.labels[train:].numpy())


@pytest.fixture()
def one_torch_thread():
    """Intra-op threads spin against each other on a shared 2-core box (10x slower fits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_label_signal_is_learnable_and_absent_without_signal(tmp_path, one_torch_thread):
    config = SyntheticConfig(num_rows=30_000, max_cardinality=2_000, row_group_size=10_000)
    generate(config, tmp_path / "signal", progress=False)
    assert _fit_logistic_auc(tmp_path / "signal", config) > 0.7
    noise = dataclasses.replace(config, dense_weight=0.0, effect_scale=0.0)
    generate(noise, tmp_path / "noise", progress=False)
    assert abs(_fit_logistic_auc(tmp_path / "noise", noise) - 0.5) < 0.03


def test_default_dataset_cached_keyed_and_atomic(tmp_path, monkeypatch):
    tiny = SyntheticConfig(num_rows=300, max_cardinality=50, row_group_size=100)
    first = default_dataset(tmp_path, tiny, progress=False)
    files = sorted(first.glob("*.parquet"))
    stamps = [f.stat().st_mtime_ns for f in files]
    assert pq.read_table(first).num_rows == 300
    assert default_dataset(tmp_path, tiny, progress=False) == first
    assert [f.stat().st_mtime_ns for f in files] == stamps  # not regenerated
    changed = default_dataset(tmp_path, dataclasses.replace(tiny, zipf_exponent=1.3), progress=False)
    assert changed != first and changed.parent == first.parent

    monkeypatch.setenv("TORCHREC_TPU_CACHE", str(tmp_path / "env"))
    assert default_dataset(config=tiny, progress=False).is_relative_to(tmp_path / "env")

    real_generate = synthetic.generate

    def killed_after_writing(config, output_dir, progress=True):
        real_generate(config, output_dir, progress)
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "generate", killed_after_writing)
    other = dataclasses.replace(tiny, seed=99)
    with pytest.raises(KeyboardInterrupt):
        default_dataset(tmp_path / "killed", other, progress=False)
    assert list((tmp_path / "killed" / "synthetic").iterdir()) == []


def test_a_drifting_vocabulary_brings_new_ids_and_fades_old_ones(tmp_path):
    """Each id moves up by vocabulary_drift table sizes over the rows: the first and last tenths
    of the data share few ids, every id keeps one effect, and no drift changes nothing."""
    base = SyntheticConfig(num_rows=20_000, seed=1, max_cardinality=300, rows_per_file=20_000, row_group_size=2_000)
    drifting = dataclasses.replace(base, vocabulary_drift=2.0)
    assert drifting.cache_key() != base.cache_key()
    assert dataclasses.replace(base, vocabulary_drift=0.0).cache_key() == base.cache_key()
    groups = list(SyntheticGenerator(drifting).row_groups())
    fixed = list(SyntheticGenerator(base).row_groups())
    column = "C2"  # a signal feature of 300 rows
    first, last = (set(pc.drop_null(groups[i].column(column)).to_numpy().tolist()) for i in (0, -1))
    assert max(last) >= 300 + 2 * 300 * 0.9 - 1 and min(first) >= 0
    assert len(first & last) < 0.05 * len(first)  # old ids faded, new ones came
    still = [set(pc.drop_null(g.column(column)).to_numpy().tolist()) for g in (fixed[0], fixed[-1])]
    assert len(still[0] & still[1]) > 0.5 * len(still[0])  # without drift the vocabulary stays
    assert max(max(s) for s in still) < 300
