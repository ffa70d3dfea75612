"""Resuming from a checkpoint: the run must be able to continue it exactly, or it is an error.

A checkpoint's ``meta.json`` records the options that shape the saved state (model, tables,
optimizers), the world size, the training data (table sizes and row count) and the data position
in rows: each rank's rows of the current epoch already trained. A resumed run may change
anything else (batch size, learning rates, epochs, steps, cadences): the batch size only changes
how the remaining rows are cut into batches, since the position is in rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrec_tpu.train.checkpoint.dirs import new_run_id, run_id_of
from torchrec_tpu.train.checkpoint.manifest import CheckpointError, read_manifest
from torchrec_tpu.train.checkpoint.store import rng_file
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.loop import LoopPosition

# options whose value is part of the saved state: a different one cannot load it exactly
STATE_OPTIONS = ("model", "engine", "embedding_dim", "dense_arch", "over_arch", "sparse_optimizer",
                 "dense_optimizer")
DCN_OPTIONS = ("dcn_num_layers", "dcn_low_rank_dim")
STREAM_OPTIONS = ("shuffle_batches", "limit_train_batches", "multi_hot_sizes")  # what the batches are
_DEFAULTS = {name: TrainConfig().option(name) for name in STATE_OPTIONS + DCN_OPTIONS + STREAM_OPTIONS}


@dataclass(frozen=True)
class ResumePoint:
    directory: Path  # the checkpoint
    step: int
    position: LoopPosition  # per rank
    world_size: int
    run_id: str  # the run it continues: its checkpoints in the root are this run's to prune

    def describe(self) -> str:
        rows = self.position.rows
        return (f"resuming from {self.directory}: step {self.step}, epoch {self.position.epoch}, "
                f"{rows * self.world_size:,} rows of the epoch already trained "
                f"({rows:,} per rank)")


def position_meta(position: LoopPosition, world_size: int) -> dict[str, int]:
    """What a checkpoint records of ``position`` (see :func:`resume_point`)."""
    return {"epoch": position.epoch, "rank_rows": position.rows, "rows": position.rows * world_size}


def resume_point(directory: Path, meta: dict[str, Any], config: TrainConfig, world_size: int,
                 table_sizes: tuple[int, ...], train_rows: int) -> ResumePoint:
    """Where ``config`` resumes the checkpoint ``directory`` (whose ``meta.json`` is ``meta``) on
    ``world_size`` ranks over training data of ``train_rows`` rows and ``table_sizes``;
    CheckpointError naming each saved and requested value that would not continue it exactly, or
    a rank's missing RNG state."""
    saved = meta.get("config")
    if not isinstance(saved, dict):  # options saved under other names are compared as their defaults
        raise CheckpointError(f"checkpoint {directory}: meta.json has no training config to resume from")
    names = STATE_OPTIONS + (DCN_OPTIONS if config.model.kind == "dlrm_dcn" else ()) + STREAM_OPTIONS
    problems = [f"--{name.replace('_', '-')} is {saved.get(name, _DEFAULTS[name])!r} in the checkpoint, "
                f"{config.option(name)!r} now" for name in names
                if saved.get(name, _DEFAULTS[name]) != config.option(name)]
    if meta.get("world_size") != world_size:
        problems.append(f"it was written by {meta.get('world_size')} rank(s), this run has {world_size} "
                        "(each rank resumes its own rows and RNG state)")
    if meta.get("table_sizes") != list(table_sizes):
        problems.append(f"its tables have {meta.get('table_sizes')} rows, this run's data and "
                        f"--num-embeddings give {list(table_sizes)}")
    if meta.get("train_rows") != train_rows:
        problems.append(f"it trained on {meta.get('train_rows')} rows, --data={config.data.source!r} has "
                        f"{train_rows} to train on (the saved position would point into other data)")
    if problems:
        raise CheckpointError(f"cannot resume {directory} exactly: " + "; ".join(problems))
    listed = read_manifest(directory)
    for rank in range(world_size):
        name = rng_file(directory, rank).relative_to(directory).as_posix()
        if name not in listed:
            raise CheckpointError(f"checkpoint {directory} has no RNG state for rank {rank} ({name})")
    try:
        step, epoch, rows = (int(meta[key]) for key in ("step", "epoch", "rank_rows"))
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"checkpoint {directory}: meta.json has no valid data position ({error})") from None
    if min(step, epoch, rows) < 0:
        raise CheckpointError(f"checkpoint {directory}: meta.json has a negative step or position")
    most = -(-train_rows // world_size)  # the largest rank's rows: ranks differ by at most one
    if rows > most:
        raise CheckpointError(f"checkpoint {directory}: its data position, {rows:,} rows into epoch {epoch} on each "
                              f"rank, is past the training data: --data={config.data.source!r} has {train_rows:,} "
                              f"rows to train on, at most {most:,} per rank over {world_size} rank(s)")
    return ResumePoint(directory, step, LoopPosition(epoch, rows), world_size, run_id_of(directory) or new_run_id())
