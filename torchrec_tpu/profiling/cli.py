"""``torchrec-tpu profile``: the training flags plus ``--steps`` -> a profile log dir and summary.

The flags that shape the training step are ``train``'s; those that only steer a training run
(how long, when to evaluate or checkpoint, what to resume: :data:`TRAIN_ONLY`) are not offered.
"""

from __future__ import annotations

import argparse
import os
import sys

from pipelines.flag_numbers import positive_int
from torchrec_tpu.errors import report_user_error
from torchrec_tpu.launcher import restart_with_xla_cpu_env
from torchrec_tpu.log_setup import say_loading
from torchrec_tpu.train.checkpoint.manifest import CheckpointError
from torchrec_tpu.train.config import ConfigError, add_config_arguments, config_from_args, log_notes
from torchrec_tpu.train.engine_kinds import ENGINES
from torchrec_tpu.train.model_kinds import MODEL_KINDS
from torchrec_tpu.train.preflight import check_outputs, check_paths

# Options of ``train`` that do not change the profiled step (a --config YAML may still hold them).
TRAIN_ONLY = frozenset({"epochs", "max_steps", "log_every", "eval_every", "target_auc", "checkpoint_dir",
                        "checkpoint_every", "keep_checkpoints", "overwrite_checkpoints", "resume", "mllog",
                        "mllog_org", "mllog_division", "mllog_platform", "mllog_status"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, skip=TRAIN_ONLY)
    parser.add_argument("--steps", type=positive_int, default=10, help="training steps to trace")
    parser.add_argument("--warmup", type=positive_int, default=2,
                        help="untraced steps first (compilation, lazy init)")
    parser.add_argument("--profile-dir", default=None, metavar="PATH",
                        help="TensorBoard log dir of the profile (default: <log-dir>/profile)")
    parser.add_argument("--top", type=positive_int, default=10, help="ops listed in the summary")


def run(args: argparse.Namespace) -> int:
    try:
        notes: list[str] = []
        config = config_from_args(args, int(os.environ.get("WORLD_SIZE", "1")), notes)
        check_outputs(config, args.config, [("--profile-dir", args.profile_dir)])
        if getattr(args, "_restartable", False) and ENGINES[config.engine.kind].runs_xla_cpu:
            restart_with_xla_cpu_env()  # the XLA:CPU step's memory and threads, before any heavy import
        log_notes(notes)
        if config.kind.single_process:
            raise ConfigError(f"profile --model {config.model.kind}: not built for this model yet (train only)")
        if not MODEL_KINDS[config.model.kind].sequences:  # a sequence dataset: checked as train checks it
            check_paths(config, int(os.environ.get("WORLD_SIZE", "1")))  # before the heavy imports below
        say_loading("profile")
        from torchrec_tpu.profiling.job import profile_training  # heavy: torch, torchrec, jax

        result = profile_training(config, args.steps, args.warmup, args.profile_dir, top=args.top)
    except (ConfigError, CheckpointError, ValueError) as error:
        return report_user_error("profile", error)
    print(result.format())
    return 0


if __name__ == "__main__":  # as ``torchrec-tpu profile``: the one entry point reports the errors
    from torchrec_tpu.cli import main

    sys.exit(main(["profile", *sys.argv[1:]]))
