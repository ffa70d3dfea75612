import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipelines.arrow_batch import RAW_IDS, batch_from_arrow, dense_transform
from pipelines.schema import CRITEO, DatasetSchema
from pipelines.text_reader import TextReader

SIZES = [1 << 20] * 26


def _sample_table(sample_csv) -> pa.Table:
    return pa.Table.from_batches(list(TextReader(sample_csv)))


def test_sample_rows_dense_and_labels_by_hand(sample_csv):
    batch = batch_from_arrow(_sample_table(sample_csv).slice(0, 8), SIZES)
    assert batch.dense_features.dtype == torch.float32 and batch.dense_features.shape == (8, 13)
    # Line 2: I2=3, I3=260, I5=17668, I8=33, I12=0, the rest missing -> 0.
    expected = [0, math.log(4), math.log(261), 0, math.log(17669), 0, 0, math.log(34), 0, 0, 0, 0, 0]
    torch.testing.assert_close(batch.dense_features[0], torch.tensor(expected, dtype=torch.float32))
    # Line 3: I2 = -1 is clamped to 0 before the log.
    assert batch.dense_features[1, 1].item() == 0.0
    assert batch.dense_features[1, 5].item() == pytest.approx(math.log(248))
    assert batch.labels.dtype == torch.float32
    assert batch.labels.tolist() == [0, 0, 0, 0, 0, 0, 0, 1]


def test_sample_sparse_lengths_values_and_hashing(sample_csv):
    sizes = [1000 + k for k in range(26)]
    batch = batch_from_arrow(_sample_table(sample_csv).slice(0, 2), sizes)
    kjt = batch.sparse_features
    assert kjt.keys() == list(CRITEO.sparse)
    assert kjt.values().dtype == torch.int64
    per_key = kjt.to_dict()
    # Line 2 has C19, C20, C22, C25, C26 missing: length 0, no id emitted.
    assert per_key["C19"].lengths().tolist() == [0, 0]
    assert per_key["C1"].lengths().tolist() == [1, 1]
    assert per_key["C1"].values().tolist() == [0x05DB9164 % 1000, 0x68FD1E64 % 1000]
    assert per_key["C26"].values().tolist() == []
    assert per_key["C24"].values().tolist() == [0xC0D61A5C % 1023, 0xDED4AAC9 % 1023]
    assert int(kjt.lengths().sum()) == kjt.values().numel() == 2 * 26 - 10


def test_record_batch_and_chunked_table_agree(sample_csv):
    batches = list(TextReader(sample_csv, block_size=4096))
    assert len(batches) > 1  # the table below has several chunks per column
    from_table = batch_from_arrow(pa.Table.from_batches(batches), SIZES)
    pieces = [batch_from_arrow(b, SIZES) for b in batches]
    assert torch.equal(torch.cat([p.dense_features for p in pieces]), from_table.dense_features)
    assert torch.equal(torch.cat([p.labels for p in pieces]), from_table.labels)
    for key in CRITEO.sparse:
        joined = torch.cat([p.sparse_features[key].values() for p in pieces])
        assert torch.equal(joined, from_table.sparse_features[key].values()), key


def test_multi_hot_and_negative_ids_hash_into_table():
    schema = DatasetSchema(label="y", dense=("d",), sparse=("a", "b"), multi_hot=frozenset({"b"}))
    table = pa.table(
        {
            "y": pa.array([1.0, 0.0, 1.0], pa.float32()),
            "d": pa.array([None, 7, -5], pa.int64()),
            "a": pa.array([-1, None, 12], pa.int64()),
            "b": pa.array([[3, 10, 11], None, []], pa.list_(pa.int64())),
        }
    )
    batch = batch_from_arrow(table, {"a": 10, "b": 4}, schema)
    a, b = batch.sparse_features["a"], batch.sparse_features["b"]
    assert a.lengths().tolist() == [1, 0, 1] and a.values().tolist() == [9, 2]
    assert b.lengths().tolist() == [3, 0, 0] and b.values().tolist() == [3, 2, 3]
    assert batch.dense_features[:, 0].tolist() == pytest.approx([0.0, math.log(8), 0.0])
    assert batch.labels.tolist() == [1.0, 0.0, 1.0]


def test_dense_transform_reference():
    raw = np.array([-3, 0, 1, 10**7], dtype=np.int64)
    assert dense_transform(raw).tolist() == pytest.approx(
        [0.0, 0.0, math.log(2), math.log(10**7 + 1)], rel=1e-6
    )
    floats = np.array([np.nan, -1.5, 2.0])
    assert dense_transform(floats).tolist() == pytest.approx([0.0, 0.0, math.log(3)])


def test_raw_id_tables_keep_their_ids_as_int64():
    schema = DatasetSchema(label="y", dense=(), sparse=("a", "b"))
    raw = [2**40 + 7, 5, 2**63 - 1]
    table = pa.table({"y": [1, 0, 1], "a": pa.array(raw, pa.int64()), "b": pa.array(raw, pa.int64())})
    values = batch_from_arrow(table, [RAW_IDS, 4], schema).sparse_features.values()
    assert values.dtype == torch.int64
    assert values.tolist() == raw + [(2**40 + 7) % 4, 5 % 4, (2**63 - 1) % 4]


def test_clear_errors():
    schema = DatasetSchema(label="y", dense=(), sparse=("a",))
    good = pa.table({"y": [1], "a": [3]})
    with pytest.raises(ValueError, match="table size of a must be > 0, got 0"):
        batch_from_arrow(good, [0], schema)
    with pytest.raises(ValueError, match="has 2 sizes"):
        batch_from_arrow(good, [4, 4], schema)
    with pytest.raises(ValueError, match=r"no size for \['a'\]"):
        batch_from_arrow(good, {"b": 4}, schema)
    with pytest.raises(TypeError, match="categorical column a must be integer"):
        batch_from_arrow(pa.table({"y": [1], "a": ["x"]}), [4], schema)
    with pytest.raises(ValueError, match="null ids inside lists"):
        batch_from_arrow(pa.table({"y": [1], "a": pa.array([[1, None]])}), [4], schema)
    with pytest.raises(ValueError, match="1 missing labels"):
        batch_from_arrow(pa.table({"y": pa.array([None], pa.int8()), "a": [1]}), [4], schema)
    with pytest.raises(KeyError, match="column 'a' missing"):
        batch_from_arrow(pa.table({"y": [1]}), [4], schema)


def test_converted_criteo_hex_ids_read_raw_are_the_hex_values(tmp_path):
    """``data convert`` stores Criteo's hex ids as their int64 values (no hashing); read with
    ``RAW_IDS`` (``train --zch``) they arrive as ``int(hex, 16)``."""
    import csv

    from pipelines.convert import convert_to_parquet
    from pipelines.parquet_reader import ParquetBatchReader
    from pipelines.sample_data import criteo_sample_csv

    convert_to_parquet([criteo_sample_csv()], tmp_path / "pq", progress=False)
    with open(criteo_sample_csv()) as f:
        rows = list(csv.DictReader(f))[:50]
    reader = ParquetBatchReader(tmp_path / "pq", 50, [RAW_IDS] * len(CRITEO.sparse), CRITEO)
    features = next(iter(reader)).sparse_features.to_dict()
    for name in ("C1", "C3", "C26"):
        want = [int(row[name], 16) for row in rows if row[name]]
        assert features[name].values().tolist() == want
        assert max(want) > 2**31  # ids the tables' rows would have folded
