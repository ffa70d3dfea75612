"""Checkpoints: model + optimizer state through torch.distributed.checkpoint, RNG, a JSON sidecar.

Each save is a new versioned directory under the checkpoint root (see dirs.py)::

    <version>/state/            DCP files: {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    <version>/rng/rank-NNNNN.pt this rank's torch / numpy / python RNG state (plain tensors)
    <version>/meta.json         {"step", "epoch", "rank_rows", "model", "config", "world_size", ...}

``meta.json``'s "model" is the architecture (:class:`~torchrec_tpu.train.model.ModelSpec`), what a
loader needs; "config" is the training options, which only ``--resume`` compares.
    <version>/manifest.json     sha256 of every file above, written last (the completion mark)

DCP stores sharded embedding tables (ShardedTensor) and the fused optimizer's per-table state
shard by shard, each rank writing only what it owns, so a checkpoint written by W ranks loads into
a model sharded over W' ranks.

Loading verifies the manifest, then reads through checkpoint_reader.py (no code runs from a
checkpoint's files, whatever they hold).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

from torchrec_tpu.launcher import set_resume_hint
from torchrec_tpu.sharding.deferred import deferred_tables
from torchrec_tpu.train.checkpoint.dirs import (
    META_FILE,
    intact_checkpoint,
    new_tag,
    publish,
    resolve_checkpoint,
    start_version,
    version_dir,
)
from torchrec_tpu.train.checkpoint.manifest import CheckpointError
from torchrec_tpu.train.checkpoint.reader import load_state, read_state_metadata
from torchrec_tpu.train.checkpoint.rng import load_rng, save_rng
from torchrec_tpu.train.checkpoint.save_guard import guarded_save, state_bytes

STATE_DIR = "state"
RNG_DIR = "rng"
REQUIRED_FILES = (META_FILE, f"{STATE_DIR}/.metadata")
__all__ = ["META_FILE", "STATE_DIR", "CheckpointError", "load_checkpoint", "load_states", "open_checkpoint",
           "restore_rng", "resolve_checkpoint", "save_checkpoint"]


def save_checkpoint(root: Path, model: nn.Module, optimizer: Optimizer, meta: dict[str, Any], run_id: str,
                    keep: int = 2) -> Path:
    """Save a new version of the checkpoint at ``meta["step"]`` under ``root`` for the run
    ``run_id`` and publish it as ``root/latest``, keeping that run's newest ``keep``. Ctrl-C and
    a full disk are handled as :mod:`~torchrec_tpu.train.checkpoint.save_guard` says; from then on
    a stop (Ctrl-C, SIGTERM) says how to resume from it. A collective: call on every rank. Returns
    the version directory."""
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    name = [version_dir(root, int(meta["step"]), new_tag()).name]
    if distributed:
        dist.broadcast_object_list(name, src=0)
    directory = root / name[0]
    with deferred_tables():  # embedding tables read one at a time as DCP writes them, a file each
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    with guarded_save(directory, state_bytes(state) * world):
        if rank == 0:
            start_version(directory, run_id)
        directory.mkdir(parents=True, exist_ok=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory / STATE_DIR, single_file_per_rank=False))
        save_rng(rng_file(directory, rank))
        if distributed:
            dist.barrier()
        if rank == 0:
            publish(root, directory, {**meta, "world_size": world}, keep)
        if distributed:
            dist.barrier()
    set_resume_hint(root, int(meta["step"]))
    return directory


def open_checkpoint(path: Path, warn: Callable[[str], None] | None = None) -> tuple[Path, dict[str, Any]]:
    """(version directory, metadata) of the checkpoint at ``path`` (a version directory, or a
    root: its ``latest``) after verifying every file against its manifest and checking its DCP
    metadata (:func:`~torchrec_tpu.train.checkpoint.reader.read_state_metadata`). With ``warn``, a root
    whose latest is corrupt falls back to its newest intact checkpoint (see
    :func:`~torchrec_tpu.train.checkpoint.dirs.intact_checkpoint`)."""
    directory = intact_checkpoint(path, REQUIRED_FILES, warn)
    read_state_metadata(directory / STATE_DIR)  # refuses crafted metadata before any model is built
    try:
        meta = json.loads((directory / META_FILE).read_text())
        if not isinstance(meta, dict) or not any(isinstance(meta.get(k), dict) for k in ("model", "config")):
            raise ValueError("no model spec or training config in it")
    except (ValueError, TypeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"checkpoint {directory}: {META_FILE} is not valid ({error})") from None
    return directory, meta


def load_checkpoint(path: Path, model: nn.Module, optimizer: Optimizer, verify: bool = True) -> dict[str, Any]:
    """Load the checkpoint at ``path`` (a version directory, or a root: its ``latest``) into
    ``model`` and ``optimizer``, which must have its architecture (same tables, same optimizers).
    Returns its metadata. ``verify=False`` skips the manifest check (for a checkpoint
    :func:`open_checkpoint` just verified); no code from the files runs either way. A collective
    when the model is sharded."""
    if verify:
        directory, meta = open_checkpoint(path)
    else:
        directory = resolve_checkpoint(path)
        meta = json.loads((directory / META_FILE).read_text())
    load_states(directory, model, optimizer)
    return meta


def load_states(directory: Path, model: nn.Module, optimizer: Optimizer | None = None) -> None:
    """Load the checkpoint ``directory`` (verified already, :func:`open_checkpoint`) into ``model``
    and, when given, ``optimizer``: whatever their state dicts ask for, at their sharding (a
    checkpoint of any world size loads into an unsharded model). A collective when the model is
    sharded."""
    if optimizer is not None:
        _create_lazy_state(optimizer, directory)
    with deferred_tables():  # a one-rank job's tables read and installed one at a time (load_state)
        state = {"model": model.state_dict(), **({"optimizer": optimizer.state_dict()} if optimizer else {})}
    load_state(state, directory / STATE_DIR)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])


def restore_rng(path: Path, rank: int) -> None:
    """Restore this rank's random generators from the checkpoint at ``path``; CheckpointError
    when it has none for ``rank`` or the file is not an RNG state."""
    load_rng(rng_file(resolve_checkpoint(path), rank))


def rng_file(directory: Path, rank: int) -> Path:
    """The RNG state file of ``rank`` in the checkpoint ``directory``."""
    return directory / RNG_DIR / f"rank-{rank:05d}.pt"


def _create_lazy_state(optimizer: Optimizer, directory: Path) -> None:
    """Adam and the like create their state at their first step, so a fresh one's state dict asks
    the checkpoint for nothing and its moments would be lost: when the checkpoint holds optimizer
    state, each such (keyed) optimizer takes a step on zero gradients first (torchrec's
    ``init_state``; no parameter moves), and the load then fills the state it created."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    saved = read_state_metadata(directory / STATE_DIR).state_dict_metadata
    if not any(key.startswith("optimizer.state.") for key in saved):
        return
    parts = [part for _, part in optimizer.optimizers] if isinstance(optimizer, CombinedOptimizer) else [optimizer]
    for part in parts:
        if isinstance(part, KeyedOptimizerWrapper) and not part.state:
            part.init_state()
