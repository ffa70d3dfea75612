"""Checks of the paths (and the ``--plan`` file) a job reads, before it imports torch, jax or ray
(seconds each): a missing or bad file is reported in well under a second, and no run directory is
created for it."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from pipelines.output_paths import FlagPath, check_outputs_apart
from torchrec_tpu.train.checkpoint.dirs import resolve_checkpoint
from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.plan_file import check_plan_dim, check_plan_world, read_plan

PARQUET_SUFFIX = ".parquet"  # pipelines.parquet_writer's (importing it imports pyarrow)
DATA_SOURCES = ("synthetic", "sample")  # --data values that are not paths (torchrec_tpu.train.data)


def check_parquet_input(flag: str, path: str, directory_only: bool = False) -> None:
    """``path`` is a directory holding ``*.parquet`` files (or, unless ``directory_only``, one
    Parquet file); ConfigError naming ``flag`` and the path otherwise."""
    where = Path(path)
    if where.is_file() and not directory_only:
        return
    if not where.exists():
        raise ConfigError(f"{flag}={path!r}: no such directory")
    if not where.is_dir():
        raise ConfigError(f"{flag}={path!r} is a file; give a directory of Parquet files")
    if not any(where.glob(f"*{PARQUET_SUFFIX}")):
        raise ConfigError(f"{flag}={path!r} holds no {PARQUET_SUFFIX} files (convert text data with "
                          "`torchrec-tpu data convert`)")


def check_paths(config: TrainConfig, world_size: int = 1) -> None:
    """The inputs ``config`` names exist (data, npy directory, resume checkpoint) and its output
    directories are not files; a ``--plan`` file is a plan for ``world_size`` ranks and the model's
    embedding dim. ConfigError naming the flag and the path."""
    data = config.data
    if data.in_memory_binary_criteo_path is not None:
        if not Path(data.in_memory_binary_criteo_path).is_dir():
            raise ConfigError(f"--in-memory-binary-criteo-path={data.in_memory_binary_criteo_path!r}: "
                              "no such directory")
    elif data.source not in DATA_SOURCES:
        if not Path(data.source).exists():
            raise ConfigError(f"--data={data.source!r} is neither 'synthetic', 'sample' nor a directory")
        check_parquet_input("--data", data.source, directory_only=True)
    if config.checkpoint.resume is not None:
        resolve_checkpoint(Path(config.checkpoint.resume))  # FileNotFoundError: not a checkpoint
    plan = config.engine.plan
    if plan not in (None, "auto"):
        if not Path(plan).is_file():
            raise ConfigError(f"--plan={plan!r}: no such file (a plan JSON from `torchrec-tpu plan`, or 'auto')")
        loaded, source = read_plan(plan), f"--plan={plan!r}"
        check_plan_world(loaded, world_size, source)
        if config.model.kind in ("dlrm", "dlrm_dcn"):  # every table has --embedding-dim columns
            check_plan_dim(loaded, config.model.embedding_dim, source)
    for flag, path in (("--log-dir", config.loop.log_dir), ("--checkpoint-dir", config.checkpoint.checkpoint_dir)):
        if path is not None and Path(path).is_file():
            raise ConfigError(f"{flag}={path!r} is a file; give a directory (it is created if missing)")
    if config.loop.mllog is not None and Path(config.loop.mllog).is_dir():
        raise ConfigError(f"--mllog={config.loop.mllog!r} is a directory; give the log file's path")


def check_outputs(config: TrainConfig, config_file: str | None, more_outputs: Sequence[FlagPath] = ()) -> None:
    """No output of the run (``--log-dir``, ``--checkpoint-dir``, ``--mllog``, and ``more_outputs``:
    ``--profile-dir``, ``--ray-storage``) is or lies inside one of its inputs (``--data``, the npy
    days, ``--config``, ``--plan``, ``--cache-dir``, ``--resume``); its directories may hold them
    (their files have names of their own), and a run writes its checkpoints where it resumes from
    and inside its log directory. ConfigError naming both flags."""
    data, engine_plan = config.data, config.engine.plan
    inputs: list[FlagPath] = [
        ("--data", None if data.source in DATA_SOURCES else data.source),
        ("--in-memory-binary-criteo-path", data.in_memory_binary_criteo_path), ("--config", config_file),
        ("--plan", None if engine_plan == "auto" else engine_plan), ("--cache-dir", data.cache_dir),
        ("--resume", config.checkpoint.resume)]
    outputs: list[FlagPath] = [("--log-dir", config.loop.log_dir),
                               ("--checkpoint-dir", config.checkpoint.checkpoint_dir), ("--mllog", config.loop.mllog),
                               *more_outputs]
    shared = {("--checkpoint-dir", "--resume"), ("--log-dir", "--resume"), ("--checkpoint-dir", "--log-dir"),
              ("--profile-dir", "--log-dir")}
    try:
        check_outputs_apart(outputs, inputs, may_share=shared, may_hold=[flag for flag, _ in outputs])
    except ValueError as error:
        raise ConfigError(str(error)) from None
