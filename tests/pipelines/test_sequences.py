"""HSTU sequence data: MovieLens (ml-1m ``::``, ml-20m CSV, the bundled real sample) and Yambda
Parquet read into events; the windowed sequence layout against hand-built rows; the batch reader's
history cut and id hashing; the synthetic generator's determinism and learnable signal."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.sample_data import MOVIELENS_SAMPLE_ROWS, movielens_sample_csv
from pipelines.sequences import (
    Events,
    read_meta,
    read_movielens,
    read_yambda,
    synthetic_events,
    window_path,
    write_sequences,
)
from pipelines.sequences.reader import SequenceReader


def _events():
    #          u1 ---------------------------  u2 -----------
    user = np.array([1, 1, 1, 1, 2, 2])
    item = np.array([10, 11, 12, 13, 20, 21])
    action = np.array([1, 0, 1, 1, 0, 1])
    ts = np.array([100, 200, 300, 400, 150, 350])
    order = np.array([3, 0, 5, 1, 4, 2])  # any input order
    return Events(user=user[order], item=item[order], action=action[order], timestamp=ts[order],
                  labels={"positive": action[order].astype(np.float32)}, action_rows=2, source="hand")


def _rows(path):
    return pq.read_table(path).to_pylist()


def test_windows_hold_each_users_next_events_after_everything_before(tmp_path):
    meta = write_sequences(_events(), tmp_path, windows=2, max_history=2, candidates=1)
    assert meta.windows == 2 and meta.boundaries == (201,) and meta.rows == (3, 3) and meta.item_rows == 22
    assert read_meta(tmp_path) == meta
    first = [(r["user"], r["item"], r["timestamp"], r["candidate_item"], r["label_positive"])
             for r in _rows(window_path(tmp_path, 0))]
    assert first == [(1, [], [], [10], [1.0]), (1, [10], [100], [11], [0.0]), (2, [], [], [20], [0.0])]
    second = [(r["user"], r["item"], r["action"], r["candidate_item"], r["candidate_timestamp"])
              for r in _rows(window_path(tmp_path, 1))]
    # window T + 1 rows see the earlier window's events, at most max_history of them
    assert second == [(1, [10, 11], [1, 0], [12], [300]), (1, [11, 12], [0, 1], [13], [400]),
                      (2, [20], [0], [21], [350])]


def test_several_candidates_per_row_and_a_used_directory_is_refused(tmp_path):
    write_sequences(_events(), tmp_path, windows=1, max_history=5, candidates=3)
    rows = _rows(window_path(tmp_path, 0))
    assert [(r["item"], r["candidate_item"]) for r in rows] == [([], [10, 11, 12]), ([10, 11, 12], [13]),
                                                               ([], [20, 21])]
    with pytest.raises(FileExistsError, match="already holds a sequence dataset"):
        write_sequences(_events(), tmp_path)


def test_movielens_1m_and_20m_formats(tmp_path):
    dat = tmp_path / "ratings.dat"
    dat.write_text("1::1193::5::978300760\n1::661::3::978302109\n2::1357::4::978298709\n")
    ml1m = read_movielens(dat)
    assert ml1m.user.tolist() == [1, 1, 2] and ml1m.item.tolist() == [1193, 661, 1357]
    assert ml1m.action.tolist() == [10, 6, 8] and ml1m.labels["positive"].tolist() == [1.0, 0.0, 1.0]
    csv = tmp_path / "ratings.csv"
    csv.write_text("userId,movieId,rating,timestamp\n1,2,3.5,1112486027\n1,29,4.0,1112484676\n")
    ml20m = read_movielens(csv)
    assert ml20m.action.tolist() == [7, 8] and ml20m.labels["positive"].tolist() == [0.0, 1.0]
    assert ml20m.timestamp.tolist() == [1112486027, 1112484676]
    (tmp_path / "bad.dat").write_text("1::2::3\n")
    with pytest.raises(ValueError, match="line 1 is not UserID::MovieID::Rating::Timestamp"):
        read_movielens(tmp_path / "bad.dat")


def test_the_bundled_real_movielens_sample_converts(tmp_path):
    events = read_movielens(movielens_sample_csv())
    assert len(events) == MOVIELENS_SAMPLE_ROWS
    assert (events.user[0], events.item[0], events.action[0], events.timestamp[0]) == (3299, 235, 8, 968035345)
    meta = write_sequences(events, tmp_path, windows=2, candidates=1)
    assert meta.rows == (100, 100)  # each rating is one row's candidate, half the ratings per window
    later = pq.read_table(window_path(tmp_path, 1)).to_pylist()
    assert all(t < c for r in later for t in r["timestamp"] for c in r["candidate_timestamp"])


def test_yambda_parquet(tmp_path):
    path = tmp_path / "multi_event.parquet"
    pq.write_table(pa.table({
        "uid": [7, 7, 7, 8], "timestamp": [10, 20, 30, 15], "item_id": [100, 101, 100, 5],
        "is_organic": [1, 0, 1, 1], "played_ratio_pct": pa.array([80, 20, None, 50], pa.int32()),
        "track_length_seconds": [200, 180, 200, 90],
        "event_type": ["listen", "listen", "like", "listen"]}), path)
    events = read_yambda(path)
    assert events.action.tolist() == [0, 0, 1, 0]
    assert events.labels["listen_plus"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert events.labels["like"].tolist() == [0.0, 0.0, 1.0, 0.0]
    pq.write_table(pa.table({"uid": [1], "item_id": [2], "timestamp": [3], "event_type": ["skip"],
                             "played_ratio": [0.9]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="unknown event_type 'skip'"):
        read_yambda(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"uid": [1], "item_id": [2]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match=r"columns missing: \['event_type', 'timestamp', 'played_ratio_pct"):
        read_yambda(tmp_path / "other.parquet")


def test_reader_cuts_histories_hashes_items_and_stacks_labels(tmp_path):
    write_sequences(_events(), tmp_path, windows=2, max_history=2, candidates=1)
    reader = SequenceReader(window_path(tmp_path, 1), batch_size=2, max_history=1, item_rows=11)
    batches = list(reader)
    assert len(reader) == len(batches) == 2
    kjt = batches[0].features
    assert kjt["item"].values().tolist() == [0, 1]  # last event only: 11 and 12, mod 11
    assert kjt["timestamp"].values().tolist() == [200, 300]
    assert kjt["candidate_item"].values().tolist() == [1, 2]
    assert batches[0].labels.tolist() == [[1.0], [1.0]] and batches[1].users == 1
    with pytest.raises(ValueError, match=r"tasks \['click'\] not among the file's labels \['positive'\]"):
        SequenceReader(window_path(tmp_path, 1), 2, max_history=1, tasks=["click"])


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    ranks = np.argsort(np.argsort(scores)) + 1
    pos = labels == 1
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum()))


def test_synthetic_is_deterministic_and_its_labels_are_learnable():
    a, b = synthetic_events(300, 50, 40, seed=3), synthetic_events(300, 50, 40, seed=3)
    assert np.array_equal(a.item, b.item) and np.array_equal(a.timestamp, b.timestamp)
    assert not np.array_equal(a.item, synthetic_events(300, 50, 40, seed=4).item)
    label = a.labels["positive"]
    half = len(a) // 2
    item_rate = np.bincount(a.item[:half], weights=label[:half], minlength=50) / np.maximum(
        np.bincount(a.item[:half], minlength=50), 1)
    assert _auc(item_rate[a.item[half:]], label[half:]) > 0.62  # the item alone predicts held-out labels
    assert torch.tensor(label).mean().item() == pytest.approx(0.5, abs=0.15)
