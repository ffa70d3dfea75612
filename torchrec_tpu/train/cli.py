"""``torchrec-tpu train``: flags (and ``--config``) -> :func:`torchrec_tpu.train.job.run_job`.

Runs on a world of one by default; under ``torchrun --nproc-per-node N`` each process joins the
world from the environment and the tables are sharded over all of them; with ``--ray-workers N``
the driver launches N Ray Train workers that do the same (:mod:`torchrec_tpu.train.ray_train`).
"""

from __future__ import annotations

import argparse
import os

from pipelines.flag_numbers import non_negative_int
from torchrec_tpu.errors import report_user_error
from torchrec_tpu.launcher import restart_with_xla_cpu_env
from torchrec_tpu.log_setup import say_loading
from torchrec_tpu.train.checkpoint.manifest import CheckpointError
from torchrec_tpu.train.config import (
    ConfigError,
    add_config_arguments,
    check_batch_split,
    config_from_args,
    log_notes,
)
from torchrec_tpu.train.engine_kinds import ENGINES
from torchrec_tpu.train.preflight import check_outputs, check_paths
from torchrec_tpu.train.ray_train import RayOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    ray = parser.add_argument_group("Ray Train (launch options, not saved in checkpoints)")
    ray.add_argument("--ray-workers", type=non_negative_int, default=0, metavar="N",
                     help="train on N Ray Train workers (ranks), each fed by a streaming_split of one Ray Data "
                          "stream, checkpoints reported to Ray, restarts from the last one (default: 0, no Ray)")
    ray.add_argument("--ray-max-failures", type=int, default=3, metavar="N",
                     help="worker-group restarts before the run fails (-1: no limit)")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="the Ray cluster to run on ('auto', 'ray://head:10001') (default: a private local "
                          "instance with N+1 CPUs, gone when the driver exits)")
    ray.add_argument("--ray-cpus-per-worker", type=float, default=1.0, metavar="X", help="CPUs each worker reserves")
    ray.add_argument("--ray-storage", default=None, metavar="PATH|URI",
                     help="where Ray keeps the reported checkpoints: a path every node reaches or a bucket "
                          "URI (gs://...) (default: <log-dir>/ray)")
    ray.add_argument("--ray-tpu-topology", default=None, metavar="TOPO",
                     help="one worker per TPU host of slices of this topology, e.g. 4x4 "
                          "(ScalingConfig(use_tpu=True, topology=...)); with --ray-tpu-type (default: CPU workers)")
    ray.add_argument("--ray-tpu-type", default=None, metavar="TYPE",
                     help="the TPU accelerator type of --ray-tpu-topology, e.g. TPU-V6E (default: none)")
    ray.add_argument("--ray-tpus-per-worker", type=int, default=4, metavar="N",
                     help="TPU chips each worker (one host) owns, with --ray-tpu-topology")


def ray_options(args: argparse.Namespace) -> RayOptions:
    """The ``--ray-*`` flags as :class:`RayOptions` (ConfigError for bad values)."""
    if args.ray_tpu_type and not args.ray_tpu_topology:
        raise ConfigError("--ray-tpu-type needs --ray-tpu-topology")
    return RayOptions(workers=args.ray_workers, max_failures=args.ray_max_failures, address=args.ray_address,
                      cpus_per_worker=args.ray_cpus_per_worker, storage_path=args.ray_storage,
                      use_tpu=args.ray_tpu_topology is not None, topology=args.ray_tpu_topology,
                      accelerator_type=args.ray_tpu_type, tpus_per_worker=args.ray_tpus_per_worker)


def run(args: argparse.Namespace) -> int:
    try:
        # the world is known before anything starts: torchrun's environment, or the Ray workers
        world_size = args.ray_workers or int(os.environ.get("WORLD_SIZE", "1"))
        notes: list[str] = []
        config = config_from_args(args, world_size, notes)
        check_outputs(config, args.config, [("--ray-storage", args.ray_storage)])
        if getattr(args, "_restartable", False) and ENGINES[config.engine.kind].runs_xla_cpu:
            restart_with_xla_cpu_env()  # the XLA:CPU step's memory and threads, before any heavy import
        log_notes(notes)
        model = config.kind
        if model.single_process and (args.ray_workers or world_size > 1):
            task = "" if config.model.task == "ranking" else f" --task {config.model.task}"
            raise ConfigError(f"--model {model.name}{task} trains in one process: several ranks (torchrun, "
                              "--ray-workers) are not built for it yet")
        if args.ray_workers and not model.ray:
            raise ConfigError(f"--ray-workers {args.ray_workers}: Ray Train is not built for --model {model.name} "
                              "(torchrun ranks are)")
        if not model.sequences:  # a sequence dataset is checked by the model's reader
            check_batch_split(config.data, world_size)
            check_paths(config, world_size)  # before the heavy imports below: a bad file fails in well under a second
        say_loading("train")
        if args.ray_workers:
            from torchrec_tpu.train.ray_train import as_given, train_on_ray  # heavy: ray.train, torch

            ray_run = train_on_ray(config, ray_options(args))
            print(ray_run.summary)
            print(f"  ray checkpoint  {as_given(ray_run.checkpoint)}")
            return 0
        summary = model.load("job")(config)  # heavy: torch, torchrec, fbgemm
    except (ConfigError, CheckpointError, FileNotFoundError) as error:  # bad flags, YAML, data, checkpoint
        return report_user_error("train", error)
    if summary.primary:
        print(summary.format())
    return 0
