"""Ray Train launcher: ``torchrec-tpu train --ray-workers N`` and :func:`train_on_ray`.

The same training job as a torchrun rank (:func:`torchrec_tpu.train.job.run_job`) runs in each of
N Ray Train workers (``ray.train.torch.TorchTrainer``):

- **Process group.** :class:`TpuDistConfig`, the trainer's backend config, gives every worker
  torchrun's rendezvous environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of worker 0), and the job joins it
  through :func:`~torchrec_tpu.train.distributed.process_group` exactly as a torchrun rank does:
  the same backend and transport, collective timeout and rank heartbeat.
- **Data.** The training split is one Ray Data stream (:func:`pipelines.ray_data.preprocessed_dataset`:
  one read task per Parquet row group, the dense transform and id hashing in ``map_batches``), cut
  with ``streaming_split(N, equal=True)`` by Ray Train's ``DataConfig``; each worker trains on
  its split (:class:`pipelines.ray_data.RayBatchStream`, batch-size / N rows per step). Order is
  preserved (``ExecutionOptions(preserve_order=True)``), and Ray's splitter then hands each row
  group to the split that has received the fewest rows so far (ties: the lowest rank), so which
  rows a worker trains on, in which order, is a function of the files alone: a restarted worker
  group sees the same stream, which makes the restart bit-identical. With row groups as large as
  a rank's share (``torchrun``'s contiguous row ranges), a worker gets exactly a torchrun rank's
  rows. The held-out split is read as under torchrun (each rank its own rows).
- **Checkpoints.** The job writes its usual DCP checkpoints (``--checkpoint-dir``), and after each
  save rank 0 reports the version directory with ``ray.train.report`` (every rank calls it, Ray's
  barrier): Ray copies it, our layout unchanged, to ``<storage>/train/<version name>`` and keeps
  the last ``--keep-checkpoints`` there (storage: ``--ray-storage``, a shared path or a bucket URI;
  default ``<log-dir>/ray``).
- **Failures.** When a worker dies (``FailureConfig(max_failures=...)``), Ray starts a new worker
  group, which resumes from the last reported checkpoint (``ray.train.get_checkpoint()`` ->
  ``--resume``): model, optimizer, RNG and data position, so the run finishes as an uninterrupted
  one would.

Paths (``--data``, ``--log-dir``, ``--checkpoint-dir``, ``--resume``, the cache) are read from the
driver's directory: a worker whose host has that directory runs in it with the options as given
(Ray Train starts workers in a directory of its own), so its lines, summary and TensorBoard
HParams name them as a local run does; elsewhere it runs on the paths made absolute by the driver.
On a multi-node cluster they, and the Ray storage path, must be on storage every node reaches
(NFS, GCS FUSE), as with torchrun on several hosts. Without ``address`` the run gets a private
local Ray instance (``--ray-workers`` CPUs for the workers plus one for Ray Data, a 300 MB object
store) that is shut down, with every Ray process, when the driver exits
(:func:`pipelines.ray_data.local_ray`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from torchrec_tpu.log_setup import WORKER_SETUP, configure_logging
from torchrec_tpu.train.config import HSTU_MODELS, ConfigError, TrainConfig
from torchrec_tpu.train.model_kinds import MODEL_KINDS

if TYPE_CHECKING:
    import ray.train

_log = logging.getLogger(__name__)
DATASET = "train"  # the Ray Train dataset name of the training split
DATA_CPUS = 1  # CPUs a private local Ray instance adds for Ray Data's read and preprocessing tasks
RUN_NAME = "train"  # the Ray Train run: <storage>/train/<checkpoint version>


@dataclass(frozen=True)
class RayOptions:
    """How :func:`train_on_ray` runs the job on Ray (the ``--ray-*`` flags)."""

    workers: int  # Ray Train workers = training ranks
    max_failures: int = 3  # worker-group restarts from the last checkpoint before the run fails
    address: str | None = None  # an existing cluster ("auto", "ray://head:10001"); None: private, local
    cpus_per_worker: float = 1.0
    storage_path: str | None = None  # where Ray keeps the reported checkpoints (default <log-dir>/ray)
    use_tpu: bool = False  # one TPU host per worker: ScalingConfig(use_tpu=True, topology, accelerator_type)
    topology: str | None = None  # e.g. "4x4" (with use_tpu and several workers)
    accelerator_type: str | None = None  # e.g. "TPU-V6E" (with use_tpu and several workers)
    tpus_per_worker: int = 4  # the TPU chips of one host the worker owns

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--ray-workers={self.workers} must be >= 1")
        if self.max_failures < -1:
            raise ConfigError(f"--ray-max-failures={self.max_failures} must be >= 0 (or -1: retry forever)")
        if not 0 < self.cpus_per_worker < math.inf:
            raise ConfigError(f"--ray-cpus-per-worker={self.cpus_per_worker} must be > 0 and finite")
        if self.tpus_per_worker < 1:
            raise ConfigError(f"--ray-tpus-per-worker={self.tpus_per_worker} must be >= 1")
        if self.use_tpu and self.workers > 1 and not (self.topology and self.accelerator_type):
            raise ConfigError("Ray Train on TPUs with several workers needs the slice's topology and "
                              "accelerator type (e.g. topology='4x4', accelerator_type='TPU-V6E')")

    def scaling_config(self) -> "ray.train.ScalingConfig":
        """Ray Train's ScalingConfig: ``workers`` workers of ``cpus_per_worker`` CPUs (and
        ``tpus_per_worker`` TPUs of one host each with ``use_tpu``)."""
        import ray.train

        resources: dict[str, float] = {"CPU": self.cpus_per_worker}
        if not self.use_tpu:
            return ray.train.ScalingConfig(num_workers=self.workers, resources_per_worker=resources)
        resources["TPU"] = self.tpus_per_worker
        try:  # Ray checks the worker count against the topology's hosts
            return ray.train.ScalingConfig(num_workers=self.workers, resources_per_worker=resources, use_tpu=True,
                                           topology=self.topology, accelerator_type=self.accelerator_type)
        except ValueError as error:
            raise ConfigError(f"--ray-workers={self.workers} --ray-tpu-topology={self.topology}: {error}") from None


@dataclass(frozen=True)
class RayRun:
    """The outcome of :func:`train_on_ray`."""

    summary: str  # rank 0's job summary (the text ``torchrec-tpu train`` prints)
    checkpoint: Path  # the last checkpoint Ray holds (our layout: ``--resume`` takes it)
    path: str  # the Ray Train run directory


def _backend_config() -> Any:
    """:class:`TpuDistConfig` (defined on first use: ``ray.train`` imports pydantic and more)."""
    from ray.train.backend import Backend
    from ray.train.torch import TorchConfig

    class TpuDistBackend(Backend):
        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            address, port = worker_group.execute_single(0, _address_and_port)
            worker_group.execute(_set_rendezvous_env, address, port)

    @dataclass
    class TpuDistConfig(TorchConfig):
        """Gives each Ray Train worker torchrun's rendezvous environment; the job's
        :func:`~torchrec_tpu.train.distributed.process_group` joins it."""

        backend: str = "torchrec-tpu"

        @property
        def backend_cls(self) -> type:
            return TpuDistBackend

    return TpuDistConfig()


def _address_and_port() -> tuple[str, int]:
    """This node's address and a port free on it (run on worker 0: the rendezvous store)."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def _set_rendezvous_env(address: str, port: int) -> None:
    import ray.train

    context = ray.train.get_context()
    os.environ.update({
        "MASTER_ADDR": address, "MASTER_PORT": str(port), "RANK": str(context.get_world_rank()),
        "WORLD_SIZE": str(context.get_world_size()), "LOCAL_RANK": str(context.get_local_rank()),
        "LOCAL_WORLD_SIZE": str(context.get_local_world_size()), "NODE_RANK": str(context.get_node_rank()),
    })


def _report(directory: Path, scalars: dict[str, float]) -> None:
    """Report a checkpoint the job just wrote (rank 0 hands Ray the directory; a barrier)."""
    import ray.train

    primary = ray.train.get_context().get_world_rank() == 0
    checkpoint = ray.train.Checkpoint.from_directory(str(directory.absolute())) if primary else None
    ray.train.report(scalars, checkpoint=checkpoint, checkpoint_dir_name=directory.name)


def train_worker(params: dict[str, Any]) -> str | None:
    """The training function of each Ray Train worker: the job (DLRM: on this worker's split of
    the stream; HSTU: on its rows of the window file, as a torchrun rank), from the last reported
    checkpoint after a restart; rank 0 returns the summary."""
    import ray.train

    context = ray.train.get_context()
    print(f"train: Ray Train worker {context.get_world_rank()} of {context.get_world_size()} started "
          f"(pid {os.getpid()})", flush=True)  # the worker group's start is the job's longest silence
    config = _worker_config(params)
    restored = ray.train.get_checkpoint()
    with restored.as_directory() if restored else contextlib.nullcontext() as directory:
        if directory is not None:
            config = config.with_options(resume=directory)
        if config.model.kind in HSTU_MODELS:
            from torchrec_tpu.train.job import JobHooks

            summary = MODEL_KINDS[config.model.kind].load("job")(config, JobHooks(checkpointed=_report))
        else:
            summary = _run_dlrm(config, params["train_rows"])
    return summary.format() if summary.primary else None


def _run_dlrm(config: TrainConfig, train_rows: int) -> Any:
    """DLRM's job on this worker's split of the Ray Data stream."""
    import ray.train
    import torch

    from pipelines.ray_data import RayBatchStream
    from torchrec_tpu.train.job import JobHooks, run_job
    from tpu_facts import local_batch_of

    world = ray.train.get_context().get_world_size()
    local_batch = local_batch_of(config.data.batch_size, world)
    # equal splits: N // world rows each, in full batches (fewer if --bad-values skip drops rows)
    stream = RayBatchStream(ray.train.get_dataset_shard(DATASET), local_batch, device=torch.device("cpu"),
                            drop_last=True, num_batches=train_rows // world // local_batch)
    return run_job(config, hooks=JobHooks(train_batches=stream, checkpointed=_report))


def _worker_config(params: dict[str, Any]) -> TrainConfig:
    """The options as given, with this worker moved to the driver's directory, when its host has
    that directory; else the driver's config with every path absolute."""
    if not Path(params["cwd"]).is_dir():
        return params["config"]
    os.chdir(params["cwd"])
    return params["given"]


def as_given(path: Path) -> Path:
    """``path`` relative to the current directory when under it, else as it is."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def ray_ready_config(config: TrainConfig) -> TrainConfig:
    """``config`` with every path absolute and the log directory fixed now (a restarted worker
    group must write where the first one did); ConfigError for what Ray Train cannot run."""
    if config.data.in_memory_binary_criteo_path is not None:
        raise ConfigError("--in-memory-binary-criteo-path cannot feed Ray workers; convert it to Parquet "
                          "(`torchrec-tpu data convert`) and pass the directory as --data")
    if config.data.shuffle_batches:
        raise ConfigError("--shuffle-batches shuffles a reader's batches in memory; with --ray-workers the "
                          "training stream is Ray Data's (shuffle the files' row groups instead)")
    from pipelines.synthetic import cache_root

    paths = {name: str(Path(value).absolute()) for name in ("checkpoint_dir", "resume")
             if (value := config.option(name)) is not None}
    paths["cache_dir"] = str(cache_root(config.data.cache_dir).absolute())
    if config.data.source not in ("synthetic", "sample"):
        paths["data"] = str(Path(config.data.source).absolute())
    return config.with_options(log_dir=str(config.loop.resolved_log_dir().absolute()), **paths)


# A private one-node instance has no node that can be drained or preempted: Ray Train's preemption
# watcher (an actor polling the drain state; its creation logs a C++ error about restartable
# constructor arguments) has nothing to watch there
PRIVATE_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


@contextlib.contextmanager
def ray_cluster(options: RayOptions) -> Iterator[None]:
    """The cluster at ``options.address``, or a private local one sized for the workers and Ray
    Data; reuses a Ray already initialised in this process (its owner shuts it down)."""
    import ray

    from pipelines.ray_data import local_ray, pinned_ray_address

    if options.address is None or ray.is_initialized():
        cpus = math.ceil(options.workers * options.cpus_per_worker) + DATA_CPUS
        if ray.is_initialized():
            _log.info("train: on the Ray instance of this process, %d Ray Train worker(s)", options.workers)
        else:
            _log.info("train: starting Ray (%d CPUs) for %d Ray Train worker(s)", cpus, options.workers)
        with local_ray(num_cpus=cpus, log_to_driver=True, worker_setup=WORKER_SETUP, env_vars=PRIVATE_RAY_ENV):
            yield
        return
    _log.info("train: connecting to Ray at %s for %d Ray Train worker(s)", options.address, options.workers)
    ray.init(address=options.address, log_to_driver=True, logging_level=logging.ERROR,
             runtime_env={"worker_process_setup_hook": WORKER_SETUP})
    try:
        with pinned_ray_address():
            yield
    finally:
        ray.shutdown()


def train_on_ray(config: TrainConfig, options: RayOptions) -> RayRun:
    """Train ``config`` on ``options.workers`` Ray Train workers (module docstring); raises
    ``ray.train.TrainingFailedError`` once ``options.max_failures`` restarts are spent."""
    configure_logging("train")
    # the log directory fixed now: a restarted worker group writes where the first one did
    given = config.with_options(log_dir=str(config.loop.resolved_log_dir()))
    config = ray_ready_config(given)
    scaling = options.scaling_config()  # bad TPU settings fail before any Ray starts
    if config.model.kind in HSTU_MODELS:  # each worker reads its rows of the window file, as a torchrun rank
        with ray_cluster(options):
            result = _fit(config, given, options, scaling, datasets={}, train_rows=0)
    else:
        from pipelines.parquet_reader import list_parquet_files
        from pipelines.ray_data import preprocessed_dataset, row_groups
        from pipelines.schema import CRITEO
        from torchrec_tpu.train.data import parquet_source, split_files
        from torchrec_tpu.train.distributed import DistEnv

        with parquet_source(config, DistEnv(rank=0, world_size=1, local_world_size=1)) as (source, table_sizes), \
                ray_cluster(options):
            if config.data.source == "sample":  # converted into a directory for this run: the workers read it
                config, given = config.with_options(data=str(source)), given.with_options(data=str(source))
            train_files, _ = split_files(list_parquet_files(source), config.data.eval_files, source)
            groups = row_groups(train_files, CRITEO)
            dataset = preprocessed_dataset(train_files, table_sizes, CRITEO, config.data.bad_values)
            dataset.context.enable_progress_bars = False  # the workers' output is the job's
            result = _fit(config, given, options, scaling, datasets={DATASET: dataset},
                          train_rows=sum(g.num_rows for g in groups))
    if result.error is not None:
        raise result.error
    return RayRun(summary=str(result.return_value), checkpoint=Path(result.checkpoint.path), path=str(result.path))


def _fit(config: TrainConfig, given: TrainConfig, options: RayOptions, scaling: "ray.train.ScalingConfig",
         datasets: dict[str, Any], train_rows: int) -> "ray.train.Result":
    """Ray Train's TorchTrainer of :func:`train_worker` over ``datasets``, run to its end."""
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    storage = options.storage_path or str(Path(str(config.loop.log_dir)) / "ray")
    trainer = TorchTrainer(
        train_worker, train_loop_config={"config": config, "train_rows": train_rows, "given": given,
                                         "cwd": os.getcwd()},
        torch_config=_backend_config(),
        scaling_config=scaling, datasets=datasets,
        dataset_config=ray.train.DataConfig(execution_options=ray.data.ExecutionOptions(preserve_order=True)),
        run_config=ray.train.RunConfig(
            name=RUN_NAME, storage_path=storage,
            failure_config=ray.train.FailureConfig(max_failures=options.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.checkpoint.keep_checkpoints),
            # the job's lines, not Ray Train's worker-group and reporting chatter (log_setup)
            logging_config=ray.train.LoggingConfig(log_level="WARNING")),
    )
    _log.info("train: Ray started; starting %d Ray Train worker(s) (each builds the model, then the first step "
              "compiles)", options.workers)
    return trainer.fit()
