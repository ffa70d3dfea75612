"""Ranks of a real gloo process group read disjoint shards whose union is the dataset."""

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipelines.arrow_batch import batch_from_arrow
from pipelines.parquet_reader import ParquetBatchReader
from tests.pipelines.conftest import SMALL_CONFIG

WORLD_SIZE = 2
SIZES = SMALL_CONFIG.table_sizes


def _rank_main(rank: int, store_path: str, data_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        # rank / world_size come from the process group.
        batches = list(ParquetBatchReader(data_dir, 512, SIZES, SMALL_CONFIG.schema))
        strict = ParquetBatchReader(data_dir, 512, SIZES, SMALL_CONFIG.schema, drop_last=True)
        counts = torch.tensor([len(list(strict))])
        gathered = [torch.zeros_like(counts) for _ in range(WORLD_SIZE)]
        dist.all_gather(gathered, counts)
        torch.save(
            {
                "dense": torch.cat([b.dense_features for b in batches]),
                "labels": torch.cat([b.labels for b in batches]),
                "C2": torch.cat([b.sparse_features["C2"].values() for b in batches]),
                "drop_last_counts": [int(c) for c in gathered],
            },
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_gloo_ranks_cover_dataset_exactly(small_dataset, tmp_path):
    # fork: the ranks inherit the imported torch / torchrec instead of importing them again.
    mp.start_processes(
        _rank_main,
        args=(str(tmp_path / "store"), str(small_dataset), str(tmp_path)),
        nprocs=WORLD_SIZE,
        join=True,
        start_method="fork",
    )
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    full = batch_from_arrow(pq.read_table(small_dataset), SIZES, SMALL_CONFIG.schema)
    assert torch.equal(torch.cat([p["dense"] for p in parts]), full.dense_features)
    assert torch.equal(torch.cat([p["labels"] for p in parts]), full.labels)
    assert torch.equal(torch.cat([p["C2"] for p in parts]), full.sparse_features["C2"].values())
    assert all(p["drop_last_counts"] == [4, 4] for p in parts)  # (5003 // 2) // 512
