"""Checkpoints: model + optimizer state through torch.distributed.checkpoint, RNG, a JSON sidecar.

Each save is a new versioned directory under the checkpoint root (see checkpoint_dirs.py)::

    <version>/state/            DCP files: {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    <version>/rng/rank-NNNNN.pt this rank's torch / numpy / python RNG state
    <version>/meta.json         {"step", "epoch", "batches_consumed", "config", "world_size", ...}

DCP stores sharded embedding tables (ShardedTensor) and the fused optimizer's per-table state
shard by shard, each rank writing only what it owns, so a checkpoint written by W ranks loads into
a model sharded over W' ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

from torchrec_tpu.train.checkpoint_dirs import (META_FILE, new_tag, publish, resolve_checkpoint,
                                                version_dir)
from torchrec_tpu.train.rng import load_rng, save_rng

STATE_DIR = "state"
RNG_DIR = "rng"
__all__ = ["META_FILE", "STATE_DIR", "load_checkpoint", "restore_rng", "resolve_checkpoint",
           "save_checkpoint"]


def save_checkpoint(root: Path, model: nn.Module, optimizer: Optimizer, meta: dict[str, Any],
                    keep: int = 2) -> Path:
    """Save a new version of the checkpoint at ``meta["step"]`` under ``root`` and publish it as
    ``root/latest``, keeping the newest ``keep``. A collective: call on every rank. Returns the
    version directory."""
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    tag = [new_tag()]
    if distributed:
        dist.broadcast_object_list(tag, src=0)
    directory = version_dir(root, int(meta["step"]), tag[0])
    directory.mkdir(parents=True, exist_ok=True)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
             checkpoint_id=str(directory / STATE_DIR))
    save_rng(_rng_file(directory, rank))
    if distributed:
        dist.barrier()
    if rank == 0:
        publish(root, directory, {**meta, "world_size": world}, keep)
    if distributed:
        dist.barrier()
    return directory


def load_checkpoint(path: Path, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Load the checkpoint at ``path`` (a version directory, or a root: its ``latest``) into
    ``model`` and ``optimizer``, which must have its architecture (same tables, same optimizers).
    Returns its metadata. A collective when the model is sharded."""
    directory = resolve_checkpoint(path)
    if not (directory / STATE_DIR).is_dir():
        raise FileNotFoundError(f"{directory} is not a checkpoint: no {STATE_DIR}/ inside")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=str(directory / STATE_DIR))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return json.loads((directory / META_FILE).read_text())


def restore_rng(path: Path, rank: int) -> bool:
    """Restore this rank's random generators from the checkpoint at ``path``; False when it has
    none for ``rank`` (it was written by fewer ranks)."""
    file = _rng_file(resolve_checkpoint(path), rank)
    if not file.is_file():
        return False
    load_rng(file)
    return True


def _rng_file(directory: Path, rank: int) -> Path:
    return directory / RNG_DIR / f"rank-{rank:05d}.pt"
