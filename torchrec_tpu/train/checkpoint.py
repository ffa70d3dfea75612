"""Checkpoints: model + optimizer state through torch.distributed.checkpoint, plus a JSON sidecar.

Layout of a checkpoint directory::

    <dir>/state/       DCP files: {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    <dir>/meta.json    {"step": ..., "config": {...}, "metrics": {...}, "world_size": ...}

DCP stores sharded embedding tables (ShardedTensor) and the fused optimizer's per-table state
shard by shard, so a checkpoint written by W ranks loads into a model sharded over W' ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

STATE_DIR = "state"
META_FILE = "meta.json"


def save_checkpoint(
    directory: Path, model: nn.Module, optimizer: Optimizer, meta: dict[str, Any]
) -> Path:
    """Save on every rank (collective); the primary rank writes ``meta.json``. Returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.save(state, checkpoint_id=str(directory / STATE_DIR))
    if not dist.is_initialized() or dist.get_rank() == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        (directory / META_FILE).write_text(json.dumps({**meta, "world_size": world}, indent=2))
    if dist.is_initialized():
        dist.barrier()
    return directory


def load_checkpoint(directory: Path, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer``.

    Both must already have the checkpoint's architecture (same tables, same optimizers); returns
    the JSON metadata.
    """
    meta_path = directory / META_FILE
    if not meta_path.is_file() or not (directory / STATE_DIR).is_dir():
        raise FileNotFoundError(
            f"{directory} is not a checkpoint: expected {META_FILE} and {STATE_DIR}/ inside"
        )
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=str(directory / STATE_DIR))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return json.loads(meta_path.read_text())
