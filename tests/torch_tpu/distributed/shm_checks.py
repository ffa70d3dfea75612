"""What each rank of the shared-memory all_reduce test runs (module level, so spawned ranks import it)."""

from __future__ import annotations

import datetime
import glob
import os

import torch
import torch.distributed as dist

SIZES = (300_000, 1 << 20, 70_000, 3 << 20, 1 << 20)  # elements: growth, a small one on gloo, alternating halves


def rank_data(rank: int, numel: int, dtype: torch.dtype, call: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * call + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator, dtype=dtype)
    return torch.randint(-2**40, 2**40, (numel,), generator=generator, dtype=dtype)


def reduce_both_ways(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta,
                     refuse_on: int | None = None, piece_bytes: int | None = None) -> dict:
    """All_reduces of ``SIZES`` over a tpu_dist group (gloo transport) and over plain gloo;
    ``refuse_on``: the rank whose shared memory cannot be allocated; ``piece_bytes``: the largest
    piece reduced at once."""
    import torch_tpu.distributed as tpu_dist
    from torch_tpu.distributed import shm_reduce

    if piece_bytes is not None:
        shm_reduce.MAX_PIECE_BYTES = piece_bytes

    if refuse_on == rank:
        def no_room(fd: int, offset: int, length: int) -> None:
            raise OSError(28, "No space left on device")
        os.posix_fallocate = no_room
    taken = []
    original = shm_reduce.SharedMemoryReduce.all_reduce_sum

    def counted(self, tensor):
        done = original(self, tensor)
        taken.append(done)
        return done

    shm_reduce.SharedMemoryReduce.all_reduce_sum = counted
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout,
                            pg_options=tpu_dist.TransportOptions("gloo"))
    gloo = dist.new_group(backend="gloo")
    results = []
    for call, (numel, dtype, op) in enumerate([(n, torch.float32, dist.ReduceOp.SUM) for n in SIZES]
                                              + [(1 << 19, torch.int64, dist.ReduceOp.SUM),
                                                 (1 << 20, torch.float32, dist.ReduceOp.AVG)]):
        ours, ref = rank_data(rank, numel, dtype, call), rank_data(rank, numel, dtype, call)
        dist.all_reduce(ours, op=op)
        if op == dist.ReduceOp.AVG:  # gloo has no AVG: sum, then divide as tpu_dist does
            dist.all_reduce(ref, group=gloo)
            ref /= size
        else:
            dist.all_reduce(ref, group=gloo)
        results.append((ours, ref))
    dist.barrier()
    left = glob.glob("/dev/shm/tpu_dist_*")
    shared = dist.group.WORLD._transport._shared
    dist.destroy_process_group()
    return {"results": results, "taken": taken, "files_left": left, "capacity": shared._capacity}
