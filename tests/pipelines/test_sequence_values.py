"""HSTU data refuses what would train silently wrong, in one line naming the file, the row (or
line), the column, the value and the limit: null, fractional or negative ids and timestamps in
Yambda and MovieLens (a null timestamp used to become -2^63, a float id was truncated), item ids at
or above ``--max-item-rows`` (one id of 10^12 made a 10^12-row table), and in sequence window files
labels outside [0, 1], NaN or null, a label list shorter than its candidates, fractional ids and
out-of-range action codes. Integral floats are read as the integers they are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.bad_values import BadValueError
from pipelines.sequences import read_movielens, read_yambda, synthetic_events, window_path, write_sequences
from pipelines.sequences.reader import SequenceReader
from torchrec_tpu.cli import main

YAMBDA = {"uid": [7, 7, 8], "timestamp": [10, 20, 15], "item_id": [100, 101, 5],
          "played_ratio_pct": [80, 20, 50], "event_type": ["listen", "listen", "like"]}


def _yambda(path: Path, **columns) -> Path:
    pq.write_table(pa.table({**YAMBDA, **columns}), path)
    return path


@pytest.mark.parametrize("column, values, message", [
    ("timestamp", pa.array([10, None, 15], pa.int64()), r"row 1, column timestamp: null where an integer is needed"),
    ("timestamp", [10.0, float("nan"), 15.0], r"row 1, column timestamp: nan is not an integer"),
    ("item_id", [100.0, 101.5, 5.0], r"row 1, column item_id: 101\.5 is not an integer"),
    ("uid", [7, -2, 8], r"row 1, column uid: -2 is below 0"),
    ("item_id", [100, 10**12, 5], r"row 1, column item_id: 1000000000000 is at or above 16,777,216 "
                                  r"\(the item table's rows; raise `torchrec-tpu data sequences --max-item-rows`"),
    ("event_type", pa.array([0, None, 1], pa.int64()), r"row 1, column event_type: null"),
    ("uid", pa.array([7, 2**64 - 1, 8], pa.uint64()), r"row 1, column uid: 18446744073709551615 is beyond int64"),
], ids=["null-timestamp", "nan-timestamp", "fractional-item", "negative-user", "huge-item", "null-event",
        "uint64-user"])
def test_yambda_refuses_bad_ids_and_timestamps_naming_file_row_and_value(tmp_path, column, values, message):
    path = _yambda(tmp_path / "events.parquet", **{column: values})
    with pytest.raises(BadValueError, match=f"^{path}: {message}"):
        read_yambda(path)


def test_yambda_reads_integral_floats_and_names_the_file_of_a_directory(tmp_path):
    floats = read_yambda(_yambda(tmp_path / "floats.parquet", item_id=[100.0, 101.0, 5.0],
                                 timestamp=[10.0, 20.0, 15.0]))
    ints = read_yambda(_yambda(tmp_path / "ints.parquet"))
    assert floats.item.tolist() == [100, 101, 5] and floats.timestamp.tolist() == [10, 20, 15]
    assert np.array_equal(floats.item, ints.item) and floats.item.dtype == np.int64
    folder = tmp_path / "parts"
    folder.mkdir()
    _yambda(folder / "part-0.parquet")
    bad = _yambda(folder / "part-1.parquet", timestamp=pa.array([1, 2, None], pa.int64()))
    with pytest.raises(BadValueError, match=f"^{bad}: row 2, column timestamp: null"):
        read_yambda(folder)
    both = read_yambda(_yambda(folder / "part-1.parquet", uid=[9, 9, 9]).parent)
    assert both.user.tolist() == [7, 7, 8, 9, 9, 9]
    big = read_yambda(_yambda(tmp_path / "big.parquet", item_id=[100, 10**12, 5]), max_item_rows=10**12 + 1)
    assert big.item.tolist() == [100, 10**12, 5]


@pytest.mark.parametrize("text, message", [
    ("userId,movieId,rating,timestamp\n1,2,3.5,11\n1,2.5,4.0,12\n", r"line 3, column movieId: 2\.5 is not an integer"),
    ("userId,movieId,rating,timestamp\n1,2,3.5,11\n\n1,x,4.0,12\n", r"line 4, column movieId: 'x' is not a number"),
    ("userId,movieId,rating,timestamp\n1,2,nan,11\n", r"line 2, column rating: nan is not a rating in \[0, 5\]"),
    ("userId,movieId,rating,timestamp\n1,2,3\n", r"line 2, column timestamp: null where an integer is needed"),
    ("userId,movieId,rating,timestamp\n1,1000000000000,4,12\n", r"line 2, column movieId: 1000000000000 is at or "
                                                                r"above 16,777,216"),
    ("1::2::3::4\n\n-1::2::3::4\n", r"line 3, column UserID: -1 is below 0"),
], ids=["fractional-item", "text-item", "nan-rating", "missing-timestamp", "huge-item", "negative-user-1m"])
def test_movielens_refuses_bad_values_naming_the_line(tmp_path, text, message):
    path = tmp_path / "ratings.csv"
    path.write_text(text)
    with pytest.raises(BadValueError, match=f"^{path}: {message}"):
        read_movielens(path)


def test_movielens_reads_integral_float_ids(tmp_path):
    path = tmp_path / "ratings.csv"
    path.write_text("userId,movieId,rating,timestamp\n1,2.0,3.5,11\n1.0,3,4.0,12\n")
    events = read_movielens(path)
    assert events.user.tolist() == [1, 1] and events.item.tolist() == [2, 3] and events.action.tolist() == [7, 8]


def test_data_sequences_refuses_a_huge_item_id_in_one_line_and_the_flag_raises_the_limit(tmp_path, capsys):
    path = tmp_path / "ratings.csv"
    path.write_text("userId,movieId,rating,timestamp\n1,2,4,11\n1,3000,4,12\n2,2,4,13\n2,4,1,14\n")
    argv = ["data", "sequences", "movielens", str(path), "--windows", "1", "--candidates", "1"]
    assert main([*argv, "-o", str(tmp_path / "a"), "--max-item-rows", "3000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"torchrec-tpu data sequences: error: {path}: line 3, column movieId: 3000 is at or above 3,000 "
                   "(the item table's rows; raise `torchrec-tpu data sequences --max-item-rows` or remap the ids)")
    assert not (tmp_path / "a").exists()
    assert main([*argv, "-o", str(tmp_path / "b"), "--max-item-rows", "3001"]) == 0
    assert "3,001 item rows" in capsys.readouterr().out
    assert main(["data", "sequences", "synthetic", "-o", str(tmp_path / "c"), "--items", str(10**12)]) == 2
    assert capsys.readouterr().err.strip() == ("torchrec-tpu data sequences: error: data sequences synthetic: --items "
                                               "1000000000000 is above --max-item-rows 16777216")


def _window(tmp_path: Path) -> tuple[Path, pa.Table]:
    directory = tmp_path / "seq"
    write_sequences(synthetic_events(users=20, items=10, events_per_user=6, seed=1), directory, windows=2,
                    max_history=5, candidates=2)
    path = window_path(directory, 0)
    return path, pq.read_table(path)


def _rewritten(path: Path, table: pa.Table, column: str, rows: list, kind: pa.DataType | None = None) -> Path:
    out = path.with_name("edited.parquet")
    pq.write_table(table.set_column(table.schema.get_field_index(column), column, pa.array(rows, kind)), out)
    return out


def _edit(rows: list, row: int, position: int, value) -> list:
    rows = [list(r) for r in rows]
    rows[row][position] = value
    return rows


@pytest.mark.parametrize("value, shown", [(7.0, "7.0"), (-3.0, "-3.0"), (float("nan"), "nan"), (None, "null")])
def test_the_sequence_reader_refuses_a_label_outside_0_1_nan_or_null(tmp_path, value, shown):
    path, table = _window(tmp_path)
    labels = table.column("label_positive").to_pylist()
    edited = _rewritten(path, table, "label_positive", _edit(labels, 4, 1, value), pa.list_(pa.float32()))
    with pytest.raises(BadValueError, match=f"^{edited}: row 4, column label_positive: {shown} is not a label in "
                                            r"\[0, 1\]$"):
        SequenceReader(edited, 4, max_history=5)


def test_the_sequence_reader_refuses_missing_labels_fractional_ids_and_unknown_actions(tmp_path):
    path, table = _window(tmp_path)
    labels = table.column("label_positive").to_pylist()
    short = _rewritten(path, table, "label_positive", [r[:1] if i == 5 else r for i, r in enumerate(labels)],
                       pa.list_(pa.float32()))
    with pytest.raises(BadValueError, match=r"row 5, column label_positive: 1 labels for 2 candidates"):
        SequenceReader(short, 4, max_history=5)
    items = table.column("candidate_item").to_pylist()
    fractional = _rewritten(path, table, "candidate_item", _edit([[float(v) for v in r] for r in items], 2, 0, 1.5),
                            pa.list_(pa.float64()))
    with pytest.raises(BadValueError, match=r"row 2, column candidate_item: 1\.5 is not an integer"):
        SequenceReader(fractional, 4, max_history=5)
    negative = _rewritten(path, table, "candidate_item", _edit(items, 2, 0, -3))
    with pytest.raises(BadValueError, match=r"row 2, column candidate_item: -3 is below 0"):
        SequenceReader(negative, 4, max_history=5)
    actions = table.column("action").to_pylist()
    row = next(i for i, r in enumerate(actions) if r)
    unknown = _rewritten(path, table, "action", _edit(actions, row, 0, 2))
    with pytest.raises(BadValueError, match=f"row {row}, column action: 2 is at or above 2 \\(the dataset's "
                                            r"action_rows \(meta.json\)\)"):
        SequenceReader(unknown, 4, max_history=5, action_rows=2)


def test_the_sequence_reader_reads_integral_float_ids_as_the_integers(tmp_path):
    path, table = _window(tmp_path)
    for column in ("item", "candidate_item", "timestamp"):
        rows = [[float(v) for v in r] for r in table.column(column).to_pylist()]
        table = table.set_column(table.schema.get_field_index(column), column, pa.array(rows, pa.list_(pa.float64())))
    floats = path.with_name("floats.parquet")
    pq.write_table(table, floats)
    for a, b in zip(SequenceReader(path, 8, max_history=5), SequenceReader(floats, 8, max_history=5), strict=True):
        assert a.features.keys() == b.features.keys()
        assert a.features.values().tolist() == b.features.values().tolist()
        assert a.features.lengths().tolist() == b.features.lengths().tolist()


def test_the_sequence_reader_refuses_a_row_longer_than_the_models_max_seq_len(tmp_path):
    path, table = _window(tmp_path)
    pairs = zip(table.column("item").to_pylist(), table.column("candidate_item").to_pylist())
    row = next(i for i, (h, c) in enumerate(pairs) if len(h) >= 3 and len(c) == 2)
    history = min(len(table.column("item")[row].as_py()), 5)
    longer = table
    for column, value in (("candidate_item", 1), ("candidate_timestamp", 10**10), ("label_positive", 1.0)):
        rows = table.column(column).to_pylist()
        rows[row] = rows[row] + [value] * 8  # 10 candidates where the dataset said 2
        longer = longer.set_column(longer.schema.get_field_index(column), column,
                                   pa.array(rows, table.schema.field(column).type))
    edited = path.with_name("longer.parquet")
    pq.write_table(longer, edited)
    SequenceReader(edited, 4, max_history=5, max_seq_len=history + 10)  # fits exactly
    with pytest.raises(BadValueError, match=f"^{edited}: row {row}, column candidate_item: 10 candidates after "
                                            f"{history} history events make {history + 10}, above the model's "
                                            f"max_seq_len {history + 9} "):
        SequenceReader(edited, 4, max_history=5, max_seq_len=history + 9)
