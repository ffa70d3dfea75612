"""What each rank of the 2-rank EmbeddingCollection test runs (module level, so spawned ranks
import it). Rank 0 has 5 samples and rank 1 has 7: the EC takes any batch size per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchrec_tpu.sharding import ShardedSparseCoreEC, TableSharding

from .ec_reference import reference_ec, sequence_loss
from .reference import OPTIMIZERS, random_kjt, slice_batch

TW, RW, CW, DP = "table_wise", "row_wise", "column_wise", "data_parallel"
RANK_SAMPLES = (0, 5, 12)  # rank r holds global samples [RANK_SAMPLES[r], RANK_SAMPLES[r + 1])
# name -> (optimizer, per-table sharding)
EC_LAYOUTS = {
    "table_wise": ("adagrad", {"t_user": TableSharding(TW, (0,)), "t_item": TableSharding(TW, (1,)),
                               "t_small": TableSharding(TW, (1,))}),
    "row_wise": ("rowwise_adagrad", {n: TableSharding(RW) for n in ("t_user", "t_item", "t_small")}),
    "column_wise": ("adagrad", {"t_user": TableSharding(CW, (1, 0)), "t_item": TableSharding(CW, (0, 1)),
                                "t_small": TableSharding(TW, (0,))}),
    "data_parallel": ("sgd", {"t_user": TableSharding(DP), "t_item": TableSharding(DP),
                              "t_small": TableSharding(RW)}),
}


def train_sharded_ec(rank: int, world_size: int, store, timeout, layouts: list[str], steps: int, backend: str):
    """Per layout: this rank's embeddings per step (by feature) and the final unsharded weights."""
    import torch_tpu.distributed  # noqa: F401  registers the tpu_dist backend

    torch.set_num_threads(1)
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        results = {}
        start, stop = RANK_SAMPLES[rank], RANK_SAMPLES[rank + 1]
        for layout in layouts:
            optimizer, plan = EC_LAYOUTS[layout]
            ec = ShardedSparseCoreEC.from_torchrec(reference_ec(), plan, OPTIMIZERS[optimizer][0],
                                                   batch_size=stop - start, backend=backend)
            outputs = []
            for step in range(steps):
                out = ec(slice_batch(random_kjt(RANK_SAMPLES[-1], step), start, stop))
                outputs.append({name: jt.values().detach().clone() for name, jt in out.items()})
                sequence_loss(out, step).backward()
            results[layout] = (outputs, ec.unsharded_weights(), ec.unsharded_slots())
        return results
    finally:
        dist.destroy_process_group()
