"""The DLRMv4 model (MLPerf's recommendation_v4 shape, capped in rows) equals a float64 reference
written from DLRMv3's equations one user at a time (tests/hstu/reference.py); its synthetic data's
cross hash is splitmix64 (the published test vector); ids above a capped table wrap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.sequences.dlrmv4 import DLRMv4Synthetic, cross_ids, splitmix64
from tests.hstu import reference
from torchrec_tpu.hstu.dlrmv4 import (
    CONTEXTUAL,
    MLPERF_ROWS,
    DLRMv4,
    DLRMv4Config,
    action_features,
    position_ids,
    table_configs,
    time_buckets,
)

SMALL = DLRMv4Config(dim=16, layers=2, heads=2, qk_dim=4, v_dim=4, max_seq_len=64, max_rows=50,
                     preprocessor_hidden=8, item_hidden=8, position_buckets=20, time_buckets=150, input_dropout=0.0,
                     linear_dropout=0.0)
DATA = DLRMv4Synthetic(users=30, items=200, albums=20, artists=5, min_history=0, max_history=12, seed=3)


def _model(config=SMALL, seed=0):
    torch.manual_seed(seed)
    model = DLRMv4(config)
    with torch.no_grad():  # LayerNorms away from their ones/zeros init; attention that weighs
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
            if name.endswith("uvqk_weight"):
                p.mul_(4.0)
    return model.eval()


def test_the_model_equals_the_reference() -> None:
    model = _model()
    kjt, _ = DATA.batch(window=2, index=0, batch_size=5, mlperf_rows=MLPERF_ROWS)
    assert kjt["item_id"].lengths().tolist().count(0) <= 4  # a mix of lengths, maybe an empty history
    with torch.no_grad():
        got = model(kjt)
    expected = reference.dlrmv4_forward(model, kjt)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_shape_is_mlperfs_capped_only_in_rows() -> None:
    config = DLRMv4Config()
    tables = {t.name: t for t in table_configs(config)}
    assert len(tables) == 11 and {t.embedding_dim for t in tables.values()} == {512}
    assert {name: t.num_embeddings for name, t in tables.items()} == {
        name: min(rows, 65_536) for name, rows in MLPERF_ROWS.items()}
    assert len(CONTEXTUAL) == 8 and config.max_seq_len == 4096 and config.max_history == 4096 - 8 - 1
    assert (config.layers, config.heads, config.qk_dim, config.v_dim) == (3, 4, 128, 128)


def test_encoders_by_hand() -> None:
    # ActionEncoder: bits 1, 2, 4 -> rows 0, 1, 2 of the table, each in its own slot
    table = torch.arange(6.0).reshape(3, 2)
    assert action_features(torch.tensor([5, 2]), table).tolist() == [[0, 1, 0, 0, 4, 5], [0, 0, 2, 3, 0, 0]]
    # positions: contextual 0..7, then C + L - j over the history, then C for the candidate
    assert position_ids(torch.tensor([2, 0])).tolist() == [*range(8), 10, 9, 8, *range(8), 8]
    # sqrt buckets of minutes: 0 s -> 0; 3,600 s -> sqrt(60) = 7.7 -> 7; 10^9 s -> capped at 30
    assert time_buckets(torch.tensor(10**9), torch.tensor([10**9, 10**9 - 3600, 0]), 30).tolist() == [0, 7, 30]


def test_cross_hash_is_splitmix64() -> None:
    # splitmix64's first output from seed 0 (Vigna's reference implementation): 0xE220A8397B1DCDAF
    assert int(splitmix64(np.array([0], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF
    a, b = np.array([3, 3, 4]), np.array([7, 8, 7])
    ids = cross_ids([a, b], 1000)
    expected = [int(splitmix64(splitmix64(np.array([x], np.uint64)) ^ np.uint64(y))[0] % 1000) for x, y in zip(a, b)]
    assert ids.tolist() == expected and len(set(ids.tolist())) == 3


def test_a_window_is_the_same_in_any_order() -> None:
    first, _ = DATA.batch(1, 3, 4, MLPERF_ROWS)
    list(DATA.window(1, 2, 4, MLPERF_ROWS))
    again, labels = DATA.batch(1, 3, 4, MLPERF_ROWS)
    assert torch.equal(first.values(), again.values()) and labels.shape == (4,)
    day = again["item_query_time"].values()
    assert bool(((day - 1_700_000_000) // 86_400 == 1).all())
    hist = again["action_timestamp"]
    for b, times in enumerate(hist.to_dense()):
        assert bool((times < day[b]).all()) and bool((times[1:] >= times[:-1]).all())


def test_too_long_a_history_is_refused_by_name() -> None:
    config = DLRMv4Config(dim=16, layers=1, heads=2, qk_dim=4, v_dim=4, max_seq_len=12, max_rows=50,
                          preprocessor_hidden=8, item_hidden=8)
    kjt, _ = DLRMv4Synthetic(users=5, items=20, albums=4, artists=2, min_history=5, max_history=5).batch(
        0, 0, 2, MLPERF_ROWS)
    with pytest.raises(ValueError, match=r"5 history events, above max_seq_len 12 less 8 contextual tokens and 1 "
                                         r"candidate \(3\)"):
        DLRMv4(config)(kjt)
