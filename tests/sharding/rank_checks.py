"""What each rank of the 2-rank sharding test runs (module level, so spawned ranks import it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from torchrec_tpu.sharding import ShardedSparseCoreEBC, TableSharding

from .reference import OPTIMIZERS, random_kjt, reference_ebc, slice_batch, targets

TW, RW, CW, DP = "table_wise", "row_wise", "column_wise", "data_parallel"
# name -> (optimizer, per-table sharding)
LAYOUTS = {
    "table_wise": ("adagrad", {"t_user": TableSharding(TW, (0,)), "t_item": TableSharding(TW, (1,)),
                               "t_small": TableSharding(TW, (1,))}),
    "row_wise": ("rowwise_adagrad", {n: TableSharding(RW) for n in ("t_user", "t_item", "t_small")}),
    "column_wise": ("adagrad", {"t_user": TableSharding(CW, (1, 0)), "t_item": TableSharding(CW, (0, 1)),
                                "t_small": TableSharding(TW, (0,))}),
    "data_parallel": ("sgd", {"t_user": TableSharding(DP), "t_item": TableSharding(DP),
                              "t_small": TableSharding(RW)}),
    "column_wise_rowwise": ("rowwise_adagrad", {"t_user": TableSharding(CW, (1, 0)),
                                                "t_item": TableSharding(CW, (0, 1)), "t_small": TableSharding(RW)}),
}


def column_blocks(layout: str) -> dict[str, int]:
    """Per column-wise table of ``layout``, its number of column blocks."""
    return {name: len(how.ranks) for name, how in LAYOUTS[layout][1].items() if how.kind == CW}


@contextlib.contextmanager
def tpu_dist_group(rank: int, world_size: int, store, timeout) -> Iterator[None]:
    """This spawned rank in a tpu_dist world, for the duration of the block: the XLA transport
    (JAX multi-controller) for tpu tensors, the sharded modules' host tensors on its host lane."""
    import torch_tpu.distributed as tpu_dist

    torch.set_num_threads(1)
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=world_size, timeout=timeout)
    assert tpu_dist.active_transport() == "xla"
    try:
        yield
    finally:
        dist.destroy_process_group()


def train_sharded(rank: int, world_size: int, store, timeout, layouts: list[str], steps: int, local_batch: int,
                  backend: str = "xla"):
    """Per layout: this rank's pooled outputs per step and the final unsharded weights (each rank's
    shards on the local ``backend``)."""
    with tpu_dist_group(rank, world_size, store, timeout):
        results = {}
        for layout in layouts:
            optimizer, plan = LAYOUTS[layout]
            ebc = ShardedSparseCoreEBC.from_torchrec(reference_ebc(), local_batch, plan, OPTIMIZERS[optimizer][0],
                                                     backend=backend)
            outputs = train_steps(ebc, rank, world_size, steps, local_batch)
            results[layout] = (outputs, ebc.unsharded_weights(), ebc.unsharded_slots())
        return results


def train_steps(ebc: ShardedSparseCoreEBC, rank: int, world_size: int, steps: int,
                local_batch: int) -> list[torch.Tensor]:
    """``steps`` steps on this rank's part of the global batches (loss 0.5 * |out - target|^2);
    the pooled outputs of each."""
    outputs = []
    start, stop = rank * local_batch, (rank + 1) * local_batch
    for step in range(steps):
        kjt = slice_batch(random_kjt(world_size * local_batch, step), start, stop)
        out = ebc(kjt).values()
        outputs.append(out.detach().clone())
        (0.5 * ((out - targets(world_size * local_batch, step)[start:stop]) ** 2).sum()).backward()
    return outputs


def input_dists(rank: int, world_size: int, store, timeout, local_batch: int) -> dict:
    """:func:`input_dist_exchanges` and :func:`prefetched_passes` on this rank, in one job (a
    spawned job costs each rank its imports)."""
    with tpu_dist_group(rank, world_size, store, timeout):
        return {"exchanges": input_dist_exchanges(rank, world_size, local_batch),
                "passes": prefetched_passes(rank, world_size, local_batch)}


def input_dist_exchanges(rank: int, world_size: int, local_batch: int) -> dict:
    """Per pooling (``"sum"``: every table sum-pooled, no weights; ``"mixed"``: the reference's mean
    table kept): how many all_to_alls one input dist ran on this rank, and its pooled outputs."""
    from torchrec_tpu.sharding import ebc as ebc_module

    calls = [0]
    exchange = ebc_module.all_to_all

    def counted(*args, **kwargs):
        calls[0] += 1
        return exchange(*args, **kwargs)

    ebc_module.all_to_all = counted
    try:
        results = {}
        for pooling in ("sum", "mixed"):
            tables = reference_ebc(sum_pooled=pooling == "sum")
            sharded = ShardedSparseCoreEBC.from_torchrec(tables, local_batch, LAYOUTS["row_wise"][1],
                                                         OPTIMIZERS["sgd"][0])
            kjt = slice_batch(random_kjt(world_size * local_batch, 0), rank * local_batch, (rank + 1) * local_batch)
            calls[0] = 0
            batch = sharded.input_dist(kjt)
            exchanges = calls[0]
            results[pooling] = (exchanges, sharded.compute_and_output_dist(batch).values().detach().clone())
        return results
    finally:
        ebc_module.all_to_all = exchange


def prefetched_passes(rank: int, world_size: int, local_batch: int) -> dict:
    """Three passes of :class:`PrefetchedBatches` (sum-pooled tables: no gains exchange) over this
    rank's part of the global batches:
    ``"even"``, 3 batches on each rank; ``"short"``, rank 0 one batch short; ``"bad"``, rank 1's
    second batch with an id over its table. Per pass: the prefetch group's all_to_alls and
    all_reduces, the pooled outputs of the batches taken, and the error the pass ended with."""
    from torchrec.datasets.utils import Batch

    import torch_tpu.distributed as tpu_dist
    from torchrec_tpu.pipeline import PrefetchedBatches

    from .reference import with_last_id

    group = dist.new_group(pg_options=tpu_dist.TransportOptions("gloo"))
    calls = {"all_to_all_single": 0, "all_reduce": 0}
    originals = {name: getattr(dist, name) for name in calls}

    def counting(name):
        def collective(*args, **kwargs):
            calls[name] += kwargs.get("group") is group
            return originals[name](*args, **kwargs)
        return collective

    for name in calls:
        setattr(dist, name, counting(name))
    ebc = ShardedSparseCoreEBC.from_torchrec(reference_ebc(sum_pooled=True), local_batch,
                                             LAYOUTS["row_wise"][1], OPTIMIZERS["sgd"][0])
    start, stop = rank * local_batch, (rank + 1) * local_batch
    kjts = [slice_batch(random_kjt(world_size * local_batch, step), start, stop) for step in range(3)]
    passes = {"even": kjts, "short": kjts[:2] if rank == 0 else kjts,
              "bad": [kjts[0], with_last_id(kjts[1], 1000) if rank == 1 else kjts[1], kjts[2]]}
    results = {}
    for name, pass_kjts in passes.items():
        batches = [Batch(torch.zeros(local_batch, 1), kjt, torch.zeros(local_batch)) for kjt in pass_kjts]
        calls.update(all_to_all_single=0, all_reduce=0)
        outputs, error = [], None
        try:
            with torch.no_grad():
                for batch in PrefetchedBatches(batches, ebc, torch.device("cpu"), depth=2, group=group):
                    outputs.append(ebc(batch.sparse_features).values().clone())
        except Exception as failure:  # noqa: BLE001  the test compares the ranks' errors
            error = f"{type(failure).__name__}: {failure}"
        results[name] = (dict(calls), outputs, error)
    for name, original in originals.items():
        setattr(dist, name, original)
    return results
