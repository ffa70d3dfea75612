"""What each rank of the sharded-checkpoint test runs (module level, so spawned ranks import it).

Over tpu_dist, as the training job: ranks that hold no piece of a table (table-wise tables on the
other rank) included, where torch's ShardedTensor alone would ask for a CUDA device."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp

from torchrec_tpu.sharding import ShardedSparseCoreEBC

from .rank_checks import LAYOUTS, tpu_dist_group, train_steps
from .reference import OPTIMIZERS, reference_ebc

UNIFORM = "+uniform"  # a layout's suffix: on the ops backend, every rank's tables padded to one shape


def _ebc(layout: str, local_batch: int, seed: int) -> ShardedSparseCoreEBC:
    optimizer, plan = LAYOUTS[layout.removesuffix(UNIFORM)]
    options = {"backend": "ops", "uniform_ranks": True} if layout.endswith(UNIFORM) else {}
    return ShardedSparseCoreEBC.from_torchrec(reference_ebc(seed), local_batch, plan, OPTIMIZERS[optimizer][0],
                                              **options)


def _state(ebc: ShardedSparseCoreEBC):
    """Everything a checkpoint must restore, unsharded (a collective)."""
    return ebc.unsharded_weights(), ebc.unsharded_slots(), ebc.steps


def save_after_training(rank: int, world_size: int, store, timeout, directory: str, layouts: list[str],
                        steps: int, local_batch: int):
    """Per layout: train ``steps`` steps, DCP-save ``{"ebc": state_dict}`` to ``directory/<layout>``;
    return the unsharded state that was saved."""
    with tpu_dist_group(rank, world_size, store, timeout):
        results = {}
        for layout in layouts:
            ebc = _ebc(layout, local_batch, seed=0)
            train_steps(ebc, rank, world_size, steps, local_batch)
            dcp.save({"ebc": ebc.state_dict()}, checkpoint_id=f"{directory}/{layout}")
            results[layout] = _state(ebc)
        return results


def load_into_fresh(rank: int, world_size: int, store, timeout, directory: str, layouts: list[str],
                    local_batch: int):
    """Per layout: a fresh EBC (other initial weights) loads ``directory/<layout>``; returns its
    unsharded state before and after the load, and the tables of its ``to_torchrec()`` unshard."""
    with tpu_dist_group(rank, world_size, store, timeout):
        results = {}
        for layout in layouts:
            ebc = _ebc(layout, local_batch, seed=1)
            before = _state(ebc)
            state = {"ebc": ebc.state_dict()}
            dcp.load(state, checkpoint_id=f"{directory}/{layout}")
            ebc.load_state_dict(state["ebc"])
            plain = ebc.to_torchrec()
            results[layout] = (before, _state(ebc),
                               {name: bag.weight.detach().clone() for name, bag in plain.embedding_bags.items()})
        return results
