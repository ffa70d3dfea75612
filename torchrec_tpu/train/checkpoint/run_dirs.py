"""The directories a training run writes (``--log-dir``, ``--checkpoint-dir``): checked, locked
for the run (one job per directory, :mod:`~torchrec_tpu.train.checkpoint.dir_lock`), and a checkpoint root
holding another run's checkpoints refused unless the run continues it (``--resume``) or says so
(``--overwrite-checkpoints``; theirs are kept either way, see dirs.py)."""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from torchrec_tpu.train.checkpoint.dir_lock import locked
from torchrec_tpu.train.checkpoint.dirs import checkpoints_by_run
from torchrec_tpu.train.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class RunDirs:
    log_dir: Path
    checkpoint_root: Path
    created: tuple[Path, ...] = ()  # the run's directories that did not exist before it

    def remove_created(self) -> None:
        """Remove the directories this run created, unless a checkpoint was saved in them: a run
        that failed on its config leaves no ``runs/<timestamp>/`` (a TensorBoard run of nothing)."""
        if checkpoints_by_run(self.checkpoint_root):
            return
        for path in self.created:
            shutil.rmtree(path, ignore_errors=True)


def claim_run_dirs(config: TrainConfig, held: contextlib.ExitStack) -> RunDirs:
    """Check and lock the run's directories (the locks live as long as ``held``); ConfigError
    naming the flag, the directory and what is in the way (and nothing created)."""
    log_dir = config.loop.resolved_log_dir()  # a timestamped default when --log-dir is not given
    root = Path(config.checkpoint.checkpoint_dir or log_dir / "checkpoint")
    flags = {"--log-dir": log_dir, "--checkpoint-dir": root}
    for flag, path in flags.items():
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{flag}={str(path)!r} is a file; give a directory (it is created if missing)")
    dirs = RunDirs(log_dir, root, tuple(path for path in dict.fromkeys([log_dir, root]) if not path.exists()))
    try:
        for path, flag in {path.resolve(): flag for flag, path in flags.items()}.items():  # one lock per directory
            held.enter_context(locked(path, flag))
        if not (config.checkpoint.resume or config.checkpoint.overwrite_checkpoints):
            _refuse_other_runs(root)
    except ConfigError:
        dirs.remove_created()
        raise
    return dirs



def _refuse_other_runs(root: Path) -> None:
    runs = checkpoints_by_run(root)
    if not runs:
        return
    held = "; ".join(f"run {run}: {len(paths)} checkpoint(s), the newest {paths[0].name}"
                     for run, paths in runs.items())
    raise ConfigError(
        f"--checkpoint-dir={str(root)!r} holds another run's checkpoints ({held}): continue that run "
        f"with --resume {root}, give another --checkpoint-dir (or --log-dir), or pass "
        "--overwrite-checkpoints to start a new run there ('latest' moves to it; their checkpoints are kept)")
