"""One training job end to end: data -> model -> shard -> train -> evaluate -> checkpoint."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
import torchrec
from torchrec.datasets.utils import Batch

from pipelines.arrow_batch import empty_batch
from pipelines.bad_values import BadValueCounts
from torchrec_tpu.log_setup import configure_logging
from torchrec_tpu.rank_agreement import AgreedBatches
from torchrec_tpu.rank_watch import collectives
from torchrec_tpu.sharding.fdo import resume_fdo, tuned_stats
from torchrec_tpu.train.checkpoint.dirs import new_run_id
from torchrec_tpu.train.checkpoint.resume import ResumePoint, position_meta, resume_point
from torchrec_tpu.train.checkpoint.run_dirs import RunDirs, claim_run_dirs
from torchrec_tpu.train.checkpoint.store import (
    CheckpointError,
    load_checkpoint,
    open_checkpoint,
    restore_rng,
    save_checkpoint,
)
from torchrec_tpu.train.config import ConfigError, TrainConfig, check_batch_split
from torchrec_tpu.train.config_agreement import agree_on_config
from torchrec_tpu.train.data import TrainData, open_data
from torchrec_tpu.train.distributed import DistEnv, describe_transport, process_group, threads_for_this_rank
from torchrec_tpu.train.engines import Engine, engine_for
from torchrec_tpu.train.engines.step_layout import StepLayout
from torchrec_tpu.train.learning_rate import LRPolicy
from torchrec_tpu.train.loop import LoopOptions, LoopPosition, TrainResult, run_training
from torchrec_tpu.train.memory_preflight import check_model_fits
from torchrec_tpu.train.mllog import mlperf_log
from torchrec_tpu.train.model import ModelSpec
from torchrec_tpu.train.run_events import RunEvents
from torchrec_tpu.train.scalars import ScalarLog
from torchrec_tpu.train.streams import evaluation_stream, training_streams

_log = logging.getLogger(__name__)

T = TypeVar("T")
# scalars the HParams tab shows per run
FDO_STATS_FILE = "fdo_stats.json"  # in the log dir (train --fdo)
HPARAM_METRICS = ("eval/auc", "eval/ne", "eval/loss", "eval/accuracy", "train/loss")


@dataclass(frozen=True)
class JobSummary:
    result: TrainResult
    data: str
    log_dir: Path
    checkpoint_dir: Path  # the final checkpoint: a version directory under the checkpoint root
    world_size: int
    primary: bool  # whether this process is rank 0
    bad_values: tuple[str, ...] = ()  # the report of --bad-values skip/clamp, all ranks
    target_auc: float = 0.0  # --target-auc (0: none)

    def format(self) -> str:
        r = self.result
        return "\n".join([*self.bad_values,
            "training finished",
            f"  data            {self.data}",
            f"  steps           {r.steps} ({r.samples:,} samples this run, {self.world_size} rank(s))",
            f"  throughput      {self._throughput()}",
            f"  first step      {r.first_step_seconds:.2f} s (input, tracing and compiling; the persistent "
            "compile cache skips the last two from the second run on)",
            f"  train loss      {r.final_train_loss:.4f} (mean of the last steps)",
            f"  eval AUC        {r.eval.auc:.4f} (NE {r.eval.ne:.4f}, loss {r.eval.loss:.4f}, accuracy "
            f"{r.eval.accuracy:.2f}, {r.eval.samples:,} samples)",
            *([f"  test AUC        {r.test.auc:.4f} (NE {r.test.ne:.4f}, loss {r.test.loss:.4f}, accuracy "
               f"{r.test.accuracy:.2f}, {r.test.samples:,} samples)"] if r.test is not None else []),
            *([self._target_line()] if self.target_auc else []),
            f"  tensorboard     {self.log_dir}",
            f"  checkpoint      {self.checkpoint_dir}",
        ])


    def _throughput(self) -> str:
        """Steady (after the compiling first step) and whole-run samples/s: on a short run the
        first step dominates the whole-run figure."""
        r = self.result
        whole = f"{r.samples_per_sec:,.0f} samples/s whole run (input + train steps, eval excluded)"
        steady = r.steady_samples_per_sec
        if steady is None:
            return f"{whole}; one step, no steady figure"
        return f"{steady:,.0f} samples/s steady (after the first step), {whole}"

    def _target_line(self) -> str:
        r = self.result
        if r.target_step is not None:
            return f"  target AUC      {self.target_auc} reached at step {r.target_step}"
        best = "" if r.best_eval is None else f": best eval AUC {r.best_eval[1].auc:.4f} at step {r.best_eval[0]}"
        return f"  target AUC      {self.target_auc} MISSED{best}"


def model_spec(config: TrainConfig, feature_names: tuple[str, ...], table_sizes: tuple[int, ...],
               dense_in_features: int) -> ModelSpec:
    dcn = config.model.kind == "dlrm_dcn"
    return ModelSpec(
        feature_names=feature_names,
        table_sizes=table_sizes,
        embedding_dim=config.model.embedding_dim,
        dense_in_features=dense_in_features,
        dense_layers=tuple(config.model.dense_layers),
        over_layers=tuple(config.model.over_layers),
        dcn_num_layers=config.model.dcn_num_layers if dcn else 0,
        dcn_low_rank_dim=config.model.dcn_low_rank_dim if dcn else 0,
    )


@dataclass(frozen=True)
class JobHooks:
    """What a launcher changes in a job (Ray Train: :mod:`torchrec_tpu.train.ray_train`)."""

    # this rank's training batches instead of its Parquet reader's (the reader still counts the
    # split's rows, which a checkpoint records and a resume checks)
    train_batches: Iterable[Batch] | None = None
    # called on every rank after each checkpoint: (version directory, scalars of that step)
    checkpointed: Callable[[Path, dict[str, float]], None] | None = None


def use_rank_threads(config: TrainConfig, env: DistEnv, job: str) -> None:
    """Set this rank's torch CPU threads as ``--num-threads`` asks (within the CPUs it may run on):
    before anything is timed or built, as ``--dense-device auto``'s measurement depends on them."""
    threads = threads_for_this_rank(config.engine.num_threads)
    if threads != config.engine.num_threads and config.engine.num_threads and env.is_primary:
        _log.info("torchrec-tpu %s: %d CPU threads per rank instead of --num-threads %d (the CPUs each "
                  "rank may run on)", job, threads, config.engine.num_threads)
    torch.set_num_threads(threads)


def decide_layout(engine: Engine, spec: ModelSpec, env: DistEnv) -> StepLayout:
    """The job's step layout (:meth:`Engine.step_layout`), logged in one ``training layout:`` line;
    ``train`` and ``profile`` both decide it here, so they run the same step."""
    layout = engine.step_layout(spec, env)
    if env.is_primary:
        _log.info(layout.describe())
    return layout


def run_job(config: TrainConfig, device: torch.device = torch.device("cpu"),
            hooks: JobHooks = JobHooks()) -> JobSummary:
    """Train ``config`` over the current (or a fresh) process group and checkpoint the result."""
    configure_logging("train")  # the CLI's logging for Python callers too (a second call changes nothing)
    engine = engine_for(config)
    with process_group(config.engine.collective_timeout, engine.needs_device_tensors, config.engine.bind_cpus,
                       config_agreement(config)) as env, \
            collectives("the collectives of setting up or finishing the run (model sharding, DDP "
                        "init, broadcasts, the final checkpoint)"):
        return _run(config, engine, env, device, hooks)


def _run(config: TrainConfig, engine: Engine, env: DistEnv, device: torch.device, hooks: JobHooks) -> JobSummary:
    check_batch_split(config.data, env.world_size)  # the CLI checked already; Python callers and Ray workers here
    if env.world_size > 1 and env.is_primary:
        _log.info("torchrec-tpu train: %s", describe_transport(env))
    with run_dirs(config, env) as dirs:
        return _run_in(config, engine, env, device, hooks, dirs)


@contextlib.contextmanager
def run_dirs(config: TrainConfig, env: DistEnv) -> Iterator[RunDirs]:
    """The run's directories, claimed and locked by the primary while inside; the ones it created
    removed when the run fails on its config (options, files, checkpoint)."""
    with contextlib.ExitStack() as held:  # the primary's locks on the run's directories
        dirs = on_primary(lambda: claim_run_dirs(config, held), env)
        try:
            yield dirs
        except _AGREED_ERRORS:
            if env.is_primary:
                dirs.remove_created()
            raise


def config_agreement(config: TrainConfig) -> Callable[..., None]:
    """The ranks' check that they run ``config``'s options (:func:`process_group`'s ``agree``)."""
    return functools.partial(agree_on_config, config, timeout_s=config.engine.collective_timeout)


def _run_in(config: TrainConfig, engine: Engine, env: DistEnv, device: torch.device, hooks: JobHooks,
            dirs: RunDirs) -> JobSummary:
    torch.manual_seed(config.loop.seed)
    use_rank_threads(config, env, "train")
    if env.is_primary:
        _log.info("train: opening the data (--data %s)", config.data.source)
    with open_data(config, env) as data, ScalarLog(dirs.log_dir, enabled=env.is_primary) as log, \
            run_events(config, env, epoch_samples(config, data)) as events:
        log.log_hparams(config.to_dict(), HPARAM_METRICS)
        spec = model_spec(config, data.schema.sparse, data.table_sizes, len(data.schema.dense))
        zch = config.engine.zch_tables(spec.feature_names) if config.engine.zch is not None else {}
        check_model_fits(spec, config.optim.sparse_optimizer, env.world_size,
                         zch={feature: policy for feature, (policy, _) in zch.items()})
        # checked before any model is built: a checkpoint this run cannot continue fails fast
        point = on_primary(lambda: _resume_point(config, env, data), env) if config.checkpoint.resume else None
        layout = decide_layout(engine, spec, env)
        built = time.perf_counter()
        model, optimizer = _build(config, engine, spec, env, device, layout)
        run_id = point.run_id if point is not None else on_primary(new_run_id, env)  # whose checkpoints to prune
        start_step, start = _restore(point, model, optimizer, env)
        if env.is_primary:
            _log.info("model %s in %.1f s; the first training step compiles",
                      "built and restored" if point else "built", time.perf_counter() - built)
        train, held_out, test = _streams(config, engine, hooks, data, env, model, device, start.epoch)
        data_split = data.split_record() if env.is_primary else {}  # infer checks its inputs against it
        checkpoints = _Checkpoints(config, env, data, spec, model, optimizer, run_id, dirs.checkpoint_root, hooks,
                                   data_split, dirs.log_dir / FDO_STATS_FILE)
        policy = LRPolicy(config.optim.lr_warmup_steps, config.optim.lr_decay_start, config.optim.lr_decay_steps)
        result = run_training(model, optimizer, train, held_out, device, log,
                              loop_options(config, env, start_step, start, data.eval_batch_rows),
                              step_fn=engine.step_function(model, optimizer, layout), checkpoint=checkpoints.save,
                              learning_rates=engine.learning_rates(policy, model, optimizer).at,
                              eval_forward=engine.eval_forward(model, layout), test=test, events=events)
        checkpoint_dir = checkpoints.save(result.steps, result.position, samples=result.samples,
                                          metrics=_final_metrics(result))
        if env.is_primary:
            _log.info("checkpoint step %d: %s", result.steps, checkpoint_dir)
            (dirs.log_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
        return JobSummary(
            result, data.describe(), dirs.log_dir, checkpoint_dir, env.world_size, env.is_primary,
            tuple(_all_ranks_bad_values(data, env).lines()), config.loop.target_auc,
        )


def _build(config: TrainConfig, engine: Engine, spec: ModelSpec, env: DistEnv, device: torch.device,
           layout: StepLayout) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The engine's sharded model (its sharding plan logged with ``--print-sharding-plan``) and optimizer."""
    model = engine.build_model(spec, env, device, layout)
    if config.engine.print_sharding_plan and env.is_primary:
        _log.info(engine.sharding_plan(model))
    return model, engine.build_optimizer(model, layout)


def _restore(point: ResumePoint | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             env: DistEnv) -> tuple[int, LoopPosition]:
    """The step and stream position the loop starts at: the resume point's, with its checkpoint
    and random state loaded (verified by :func:`_resume_point` already), else the beginning."""
    if point is None:
        return 0, LoopPosition()
    resume_fdo(model, load_checkpoint(point.directory, model, optimizer, verify=False), str(point.directory))
    restore_rng(point.directory, env.rank)
    if env.is_primary:
        _log.info(point.describe())
    return point.step, point.position


def _streams(config: TrainConfig, engine: Engine, hooks: JobHooks, data: TrainData, env: DistEnv,
             model: torch.nn.Module, device: torch.device, epoch: int) -> tuple[Any, Any, Any]:
    """(train, held-out, test) streams as the loop consumes them, the training one from ``epoch``:
    the data flags' wrappers, the ranks agreeing batch by batch on the evaluation ones (a failing
    reader stops every rank; an exhausted one evaluates padding), the engine's wrapper on training."""
    train_batches = data.train if hooks.train_batches is None else hooks.train_batches
    train, held_out = training_streams(config, train_batches, data.held_out, data.table_sizes, env.world_size, epoch)
    test = None if data.test is None else evaluation_stream(config, data.test, data.table_sizes, env.world_size)
    if env.world_size > 1:
        held_out, test = (None if split is None else AgreedBatches(
            split, None, env.rank, env.world_size, "evaluation batch", exhausted=empty_batch(data.schema))
            for split in (held_out, test))
    return engine.wrap_batches(train, model, env, device), held_out, test


def loop_options(config: TrainConfig, env: DistEnv, start_step: int, start: LoopPosition, eval_batch_rows: int = 0,
                 learning_rates: str | None = None) -> LoopOptions:
    """The loop's options of ``config`` on ``env``'s rank, from ``start_step`` at ``start``;
    ``learning_rates``: what a divergence stop names (default: the DLRM optimizers' rates)."""
    return LoopOptions(
        epochs=config.loop.epochs, max_steps=config.loop.max_steps, log_every=config.loop.log_every,
        eval_every=config.loop.eval_every, eval_batch_rows=eval_batch_rows, target_auc=config.loop.target_auc,
        checkpoint_every=config.checkpoint.checkpoint_every,
        progress=config.loop.progress and env.is_primary, primary=env.is_primary, world_size=env.world_size,
        start_step=start_step, start=start, learning_rates=learning_rates or config.optim.rates_text(),
    )


@dataclass(frozen=True)
class _Checkpoints:
    """Saves the run's checkpoints (the loop's periodic ones and the final one) with their meta."""

    config: TrainConfig
    env: DistEnv
    data: TrainData
    spec: ModelSpec
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    run_id: str
    root: Path
    hooks: JobHooks
    data_split: dict[str, Any]  # the primary's record of the data split (empty on the other ranks)
    fdo_file: Path  # where --fdo's stats go (the primary writes them at each checkpoint)

    def save(self, step: int, position: LoopPosition, **extra: object) -> Path:
        fdo = tuned_stats(self.model)  # a checkpoint is an FDO boundary: the limits it keeps are raised
        info = {"step": step, **position_meta(position, self.env.world_size), "model": self.spec.to_dict(),
                "config": self.config.to_dict(), "data_split": self.data_split,
                "table_sizes": list(self.data.table_sizes), "train_rows": self.data.train.num_rows, **extra,
                **({"fdo": fdo.to_json()} if fdo is not None else {}),
                "versions": {"torch": torch.__version__, "torchrec": torchrec.__version__}}
        if fdo is not None and self.env.is_primary:
            fdo.write(self.fdo_file)
        directory = save_checkpoint(self.root, self.model, self.optimizer, info, self.run_id,
                                    self.config.checkpoint.keep_checkpoints)
        if self.hooks.checkpointed is not None:
            self.hooks.checkpointed(directory, {"step": step, **info.get("metrics", {})})  # type: ignore[dict-item]
        return directory


@dataclass(frozen=True)
class ModelCheckpoints:
    """Saves a registry model's checkpoints (the loop's periodic ones and the final one): the step,
    the position in rows, ``record`` (meta.json's key and the model's architecture), the options;
    ``hooks.checkpointed`` hears each on every rank."""

    config: TrainConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    record: tuple[str, dict[str, Any]]
    run_id: str
    root: Path
    hooks: JobHooks

    def save(self, step: int, position: LoopPosition) -> Path:
        key, architecture = self.record
        meta = {"step": step, "epoch": position.epoch, "row": position.rows, key: architecture,
                "config": self.config.to_dict()}
        path = save_checkpoint(self.root, self.model, self.optimizer, meta, self.run_id,
                               self.config.checkpoint.keep_checkpoints)
        if self.hooks.checkpointed is not None:
            self.hooks.checkpointed(path, {"step": step})
        return path


def _final_metrics(result: TrainResult) -> dict[str, float]:
    """The final checkpoint's metrics."""
    return {"train_loss": result.final_train_loss, "eval_auc": result.eval.auc, "eval_loss": result.eval.loss,
            "eval_accuracy": result.eval.accuracy,
            **({"test_auc": result.test.auc, "test_loss": result.test.loss} if result.test else {})}


@contextlib.contextmanager
def run_events(config: TrainConfig, env: DistEnv, train_samples: int) -> Iterator[RunEvents]:
    """Who hears the loop's events: MLPerf's log with ``--mllog`` on the primary, else no one;
    ``train_samples``: samples in an epoch, all ranks."""
    if config.loop.mllog is None or not env.is_primary:
        yield RunEvents()
        return
    with mlperf_log(config, env.world_size, train_samples) as events:
        yield events


def epoch_samples(config: TrainConfig, data: TrainData) -> int:
    """Training samples in an epoch, all ranks: its batches (at most ``--limit-train-batches``) of
    the global batch size, the last one short on a world of one."""
    batches = len(data.train)
    if config.data.limit_train_batches:
        batches = min(batches, config.data.limit_train_batches)
    return min(batches * config.data.batch_size, data.train.num_rows)


def _all_ranks_bad_values(data: TrainData, env: DistEnv) -> BadValueCounts:
    counts = data.bad_values()
    if env.world_size == 1:
        return counts
    gathered: list[Any] = [None] * env.world_size
    torch.distributed.all_gather_object(gathered, counts)
    return sum(gathered[1:], gathered[0])


def _resume_point(config: TrainConfig, env: DistEnv, data: TrainData) -> ResumePoint:
    directory, meta = open_checkpoint(Path(config.checkpoint.resume), _log.warning)
    return resume_point(directory, meta, config, env.world_size, data.table_sizes, data.train.num_rows)


_AGREED_ERRORS = (CheckpointError, ConfigError, FileNotFoundError)  # on_primary raises them on every rank


def on_primary(compute: Callable[[], T], env: DistEnv) -> T:
    """``compute()`` run on the primary, its value (or its CheckpointError / ConfigError /
    FileNotFoundError, raised again) on every rank, so all ranks agree and none waits for one
    that failed."""
    outcome: list[Any] = [None]
    if env.is_primary:
        try:
            outcome = [("ok", compute())]
        except _AGREED_ERRORS as error:
            family = next(i for i, kind in enumerate(_AGREED_ERRORS) if isinstance(error, kind))
            outcome = [(family, str(error))]
    if env.world_size > 1:
        torch.distributed.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]  # type: ignore[misc]
    if kind == "ok":
        return value
    raise _AGREED_ERRORS[kind](value)
