import pyarrow.parquet as pq
import pytest
import torch

from pipelines.arrow_batch import batch_from_arrow
from pipelines.parquet_reader import ParquetBatchReader, list_parquet_files, shard_range
from tests.pipelines.conftest import SMALL_CONFIG

SCHEMA = SMALL_CONFIG.schema
SIZES = [97] * 26  # smaller than the generated tables, so hashing matters


def _columns(batches) -> dict[str, torch.Tensor]:
    """Per-batch tensors concatenated over batches: dense, labels, each key's lengths and ids."""
    out = {
        "dense": torch.cat([b.dense_features for b in batches]),
        "labels": torch.cat([b.labels for b in batches]),
    }
    for key in SCHEMA.sparse:
        out[f"{key}.lengths"] = torch.cat([b.sparse_features[key].lengths() for b in batches])
        out[f"{key}.values"] = torch.cat([b.sparse_features[key].values() for b in batches])
    return out


@pytest.fixture(scope="module")
def reference(small_dataset):
    return _columns([batch_from_arrow(pq.read_table(small_dataset), SIZES, SCHEMA)])


def _assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


@pytest.mark.parametrize("world_size,batch_size", [(1, 700), (2, 64), (3, 1000), (4, 333), (7, 50)])
def test_union_over_ranks_is_the_dataset(small_dataset, reference, world_size, batch_size):
    all_batches = []
    sizes = []
    for rank in range(world_size):
        reader = ParquetBatchReader(small_dataset, batch_size, SIZES, SCHEMA, rank, world_size)
        batches = list(reader)
        assert len(batches) == len(reader)
        assert all(b.labels.numel() == batch_size for b in batches[:-1])
        assert 0 < batches[-1].labels.numel() <= batch_size
        sizes.append(sum(b.labels.numel() for b in batches))
        all_batches += batches
    assert sum(sizes) == SMALL_CONFIG.num_rows and max(sizes) - min(sizes) <= 1
    _assert_same(_columns(all_batches), reference)


def test_drop_last_gives_equal_full_batches(small_dataset, reference):
    world_size, batch_size = 3, 256
    per_rank = (SMALL_CONFIG.num_rows // world_size) // batch_size  # 1667 // 256 = 6
    dropped = 0
    for rank in range(world_size):
        reader = ParquetBatchReader(
            small_dataset, batch_size, SIZES, SCHEMA, rank, world_size, drop_last=True
        )
        batches = list(reader)
        assert len(batches) == len(reader) == per_rank
        assert all(b.labels.numel() == batch_size for b in batches)
        start = shard_range(SMALL_CONFIG.num_rows, rank, world_size)[0]
        kept = slice(start, start + per_rank * batch_size)
        torch.testing.assert_close(_columns(batches)["dense"], reference["dense"][kept])
        dropped += reader.rows_dropped
    assert dropped == SMALL_CONFIG.num_rows - world_size * per_rank * batch_size


@pytest.mark.parametrize("drop_last", [False, True])
def test_iter_from_seeks_to_the_batches_iteration_yields(small_dataset, drop_last):
    reader = ParquetBatchReader(small_dataset, 333, SIZES, SCHEMA, rank=1, world_size=2, drop_last=drop_last)
    batches = list(reader)
    for first in (0, 4, len(batches) - 1):  # 4: inside a row group
        _assert_same(_columns(list(reader.iter_from(first))), _columns(batches[first:]))
    assert list(reader.iter_from(len(batches))) == list(reader.iter_from(len(batches) + 3)) == []
    with pytest.raises(ValueError, match="batch index must be >= 0"):
        list(reader.iter_from(-1))


def test_file_list_order_and_errors(small_dataset, tmp_path):
    files = list_parquet_files(small_dataset)
    assert [f.name for f in files] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    reader = ParquetBatchReader(files[::-1], 4096, SIZES, SCHEMA)
    assert reader.num_rows == SMALL_CONFIG.num_rows and reader.files == files[::-1]
    with pytest.raises(FileNotFoundError, match="no .parquet files"):
        ParquetBatchReader(tmp_path, 8, SIZES, SCHEMA)
    with pytest.raises(ValueError, match="rank < world_size"):
        ParquetBatchReader(small_dataset, 8, SIZES, SCHEMA, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size must be > 0"):
        ParquetBatchReader(small_dataset, 0, SIZES, SCHEMA)


def test_shard_range_covers_rows_once():
    for n in (0, 1, 10, 101):
        for w in (1, 2, 3, 8):
            ranges = [shard_range(n, r, w) for r in range(w)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
