"""``torchrec-tpu train``: flags (and ``--config``) -> :func:`torchrec_tpu.train.job.run_job`.

Runs on a world of one by default; under ``torchrun --nproc-per-node N`` each process joins the
gloo world from the environment and the tables are sharded over all of them.
"""

from __future__ import annotations

import argparse
import sys

from torchrec_tpu.train.checkpoint_manifest import CheckpointError
from torchrec_tpu.train.config import ConfigError, add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        from torchrec_tpu.train.job import run_job  # heavy: torch, torchrec, fbgemm

        summary = run_job(config)
    except (ConfigError, CheckpointError, FileNotFoundError) as error:  # bad flags, YAML, data, checkpoint
        print(f"torchrec-tpu train: error: {error}", file=sys.stderr)
        return 2
    if summary.primary:
        print(summary.format())
    return 0
