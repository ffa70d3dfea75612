"""``train``'s options as the registry tests walk them: the ones ``--help`` lists, a value for each,
the config a command line gives, and the sources where a model's job reads its options."""

from __future__ import annotations

import argparse

from tests.train.conftest import REPO_ROOT
from torchrec_tpu.cli import build_parser
from torchrec_tpu.train.config import TrainConfig, config_from_args
from torchrec_tpu.train.model_kinds import ModelKind

# train's options that are not training options: the YAML file, and how Ray Train launches the ranks
# (torchrec_tpu.train.ray_train runs every model's job on its workers)
LAUNCH_OPTIONS = {"config", "ray_workers", "ray_max_failures", "ray_address", "ray_cpus_per_worker", "ray_storage",
                  "ray_tpu_topology", "ray_tpu_type", "ray_tpus_per_worker"}
# what every model's job shares (the loop's options, directories, MLPerf's log, the ranks): with the
# job's own module, each option a model reads is read there, by its config field's name
SHARED_JOB_SOURCES = ("torchrec_tpu/train/job.py", "torchrec_tpu/train/checkpoint/run_dirs.py",
                      "torchrec_tpu/train/mllog.py", "torchrec_tpu/train/distributed.py")


def train_parser() -> argparse.ArgumentParser:
    parser = build_parser("train")
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return subparsers.choices["train"]


def options_of_help() -> list[argparse.Action]:
    """The options ``train --help`` lists."""
    return [a for a in train_parser()._actions if a.option_strings and a.help != argparse.SUPPRESS
            and a.dest != "help"]


def a_value(action: argparse.Action) -> list[str]:
    """A value ``action`` takes (its last choice, or a word or 1), as argv."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(list(action.choices)[-1])]
    return ["x" if action.type in (None, str) else "1"]


def config_of(argv: list[str]) -> TrainConfig:
    """The config of ``train argv``."""
    args, unknown = train_parser().parse_known_args(argv)
    assert not unknown
    return config_from_args(args)


def job_source(kind: ModelKind) -> str:
    """The text of ``kind``'s job and setup modules (its ``job`` and ``training``) and the modules every job shares."""
    own = {getattr(kind, part).split(":")[0].replace(".", "/") + ".py" for part in ("job", "training")}
    return "\n".join((REPO_ROOT / path).read_text() for path in (*sorted(own), *SHARED_JOB_SOURCES))
