"""What each rank of the 2-rank EmbeddingCollection test runs (module level, so spawned ranks
import it): the EBC test's layouts plus one where rank 0 serves no table, and uneven batches
(rank 0 has 5 samples, rank 1 has 7)."""

from __future__ import annotations

from torchrec_tpu.sharding import ShardedSparseCoreEC, TableSharding

from .ec_reference import reference_ec, sequence_loss
from .rank_checks import LAYOUTS, tpu_dist_group
from .reference import OPTIMIZERS, random_kjt, slice_batch

RANK_SAMPLES = (0, 5, 12)  # rank r holds global samples [RANK_SAMPLES[r], RANK_SAMPLES[r + 1])
# column-wise row-wise Adagrad is checked on the EBC (its reference trains column blocks as parameters)
EC_LAYOUTS = {name: layout for name, layout in LAYOUTS.items() if name != "column_wise_rowwise"}
EC_LAYOUTS["all_on_rank_1"] = ("sgd", {n: TableSharding("table_wise", (1,)) for n in ("t_user", "t_item", "t_small")})


def train_sharded_ec(rank: int, world_size: int, store, timeout, layouts: list[str], steps: int, backend: str):
    """Per layout: this rank's embeddings per step (by feature), the final unsharded weights and slots."""
    with tpu_dist_group(rank, world_size, store, timeout):
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
