"""``torchrec-tpu train --model dlrmv4``: MLPerf DLRMv4 (:mod:`~torchrec_tpu.hstu.dlrmv4`) set up by
:mod:`~torchrec_tpu.hstu.dlrmv4_training` and trained by the common loop
(:func:`~torchrec_tpu.train.loop.run_training`) on MLPerf's recipe (:mod:`~torchrec_tpu.hstu.dlrmv4_recipe`).

Data: ``--data synthetic`` (:class:`~pipelines.sequences.dlrmv4.DLRMv4Synthetic`, no real Yambda
here) at MLPerf's sizes, streamed by day as MLPerf's streaming mode does: ``--epochs N`` trains days
``T .. T + N - 1`` once each, in time order (MLPerf's 2,290,835,423 anchors over its 149 days, so
``N / 149`` of them; ``--limit-train-batches``: at most that many batches a day); day ``T + N`` is
the held-out set (MLPerf's 2,058,204 anchors; ``--limit-val-batches`` caps it). Evaluation every
``--eval-every`` steps, or (0) on MLPerf's grid: 0.1% of the run's training samples, from the rules'
first point; the run stops at ``--target-auc``. Checkpoints (``--checkpoint-every``, and the last
step's) hold the sharded tables, their fused optimizer's state, Adam's, every rank's RNG and the
position in the days; ``--resume`` continues one exactly at the world size that wrote it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ContextManager

from pipelines.sequences.dlrmv4 import DLRMv4Synthetic
from torchrec_tpu.hstu import dlrmv4_recipe as recipe
from torchrec_tpu.hstu.dlrmv4 import DLRMv4Config
from torchrec_tpu.hstu.dlrmv4_training import DLRMv4Training, dlrmv4_training
from torchrec_tpu.train.checkpoint.dirs import new_run_id, run_id_of
from torchrec_tpu.train.checkpoint.hstu_files import DLRMV4_META, NOT_SERVED
from torchrec_tpu.train.checkpoint.manifest import CheckpointError
from torchrec_tpu.train.checkpoint.store import load_checkpoint, open_checkpoint, restore_rng
from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.job import JobHooks, ModelCheckpoints, loop_options, on_primary, run_dirs
from torchrec_tpu.train.loop import LoopPosition, TrainResult, run_training
from torchrec_tpu.train.mllog import mlperf_log
from torchrec_tpu.train.run_events import RunEvents
from torchrec_tpu.train.scalars import ScalarLog

_log = logging.getLogger(__name__)


def not_served(*args: object, **kwargs: object) -> None:
    """``infer`` of a ``--model dlrmv4`` checkpoint: refused by name, with the reason."""
    raise ConfigError(NOT_SERVED)


@dataclass(frozen=True)
class DLRMv4Summary:
    """What a run reports."""

    primary: bool
    result: TrainResult
    seconds: float
    log_dir: Path
    checkpoint: Path

    def format(self) -> str:
        e = self.result.eval
        reached = f", --target-auc reached at step {self.result.target_step}" if self.result.target_step else ""
        return "\n".join([f"DLRMv4: {self.result.steps} steps in {self.seconds:.0f} s{reached}",
                          f"  eval (day T+1, {e.samples:,} anchors): {e.describe()}",
                          f"  TensorBoard     {self.log_dir}",
                          f"  checkpoint      {self.checkpoint}"])


def run_dlrmv4(config: TrainConfig, hooks: JobHooks = JobHooks(), config_file: str = "",
               model_config: DLRMv4Config = DLRMv4Config(), world: DLRMv4Synthetic | None = None) -> DLRMv4Summary:
    """Train and evaluate DLRMv4 as ``config`` says (module docstring) on this process's rank;
    ``hooks.checkpointed`` hears every checkpoint; ``config_file``: the YAML file given, for
    MLPerf's log; ``model_config`` and ``world``: the sizes (:func:`dlrmv4_training`)."""
    started = time.perf_counter()
    with dlrmv4_training(config, model_config, world) as t, run_dirs(config, t.env) as dirs:
        env, batch = t.env, config.data.batch_size
        step, start, run_id = 0, LoopPosition(), on_primary(new_run_id, env)
        if config.checkpoint.resume:
            step, start, run_id = _resume(Path(config.checkpoint.resume), t)
        grid = not config.loop.eval_every
        options = loop_options(config, env, step, start, learning_rates=(
            f"--sparse-lr {config.optim.sparse_lr:g} (rowwise_adagrad), --dense-lr {config.optim.dense_lr:g} (adam)"))
        options = replace(  # the days are one pass of the stream
            options, epochs=1,
            eval_every=recipe.eval_interval_steps(t.train.samples, batch) if grid else config.loop.eval_every,
            first_eval_step=recipe.first_eval_step(t.train.samples, batch) if grid else 0)
        if env.is_primary:
            _log.info("DLRMv4: days %d-%d, evaluation every %d steps from step %d", t.train.first,
                      t.train.first + t.train.days - 1, options.eval_every, options.first_eval_step)
        checkpoints = ModelCheckpoints(config, t.model, t.optimizer, (DLRMV4_META, t.model_record()), run_id,
                                       dirs.checkpoint_root, hooks)
        with ScalarLog(dirs.log_dir, env.is_primary) as scalars, _events(config, t, config_file) as events:
            result = run_training(t.model, t.optimizer, t.train, t.held_out, t.model.device, scalars, options,
                                  step_fn=lambda model, optimizer, b: t.step(b), checkpoint=checkpoints.save,
                                  learning_rates=t.rates.at, events=events)
        saved = checkpoints.save(result.steps, result.position)
        return DLRMv4Summary(env.is_primary, result, time.perf_counter() - started, dirs.log_dir, saved)


def _resume(path: Path, t: DLRMv4Training) -> tuple[int, LoopPosition, str]:
    """Load the DLRMv4 checkpoint ``path`` (one, or a root: its latest) into ``t``'s model and
    optimizers and this rank's RNG: its (step, position in the days, run id). CheckpointError when
    it is not DLRMv4's, another architecture's or another world size's."""
    directory, meta = open_checkpoint(path)
    saved = meta.get(DLRMV4_META)
    if not isinstance(saved, dict):
        raise CheckpointError(f"--resume {directory}: not a --model dlrmv4 checkpoint (no {DLRMV4_META!r} record in "
                              "its meta.json)")
    if saved != t.model_record():
        changed = sorted(k for k in saved.keys() | t.model_record().keys() if saved.get(k) != t.model_record().get(k))
        raise CheckpointError(f"--resume {directory}: its DLRMv4 differs from this run's in {', '.join(changed)}")
    if meta.get("world_size") != t.env.world_size:
        raise CheckpointError(f"cannot resume {directory} exactly: it was written by {meta.get('world_size')} "
                              f"rank(s), this run has {t.env.world_size} (each rank resumes its share of the days)")
    load_checkpoint(directory, t.model, t.optimizer, verify=False)
    restore_rng(directory, t.env.rank)
    if t.env.is_primary:
        _log.info("resuming from %s: step %d", directory, meta["step"])
    return int(meta["step"]), LoopPosition(int(meta["epoch"]), int(meta["row"])), run_id_of(directory) or new_run_id()


def _events(config: TrainConfig, t: DLRMv4Training, config_file: str) -> ContextManager[RunEvents]:
    """MLPerf's dlrmv4 log with ``--mllog`` on the primary, else no one hears the loop's events."""
    if config.loop.mllog is None or not t.env.is_primary:
        return contextlib.nullcontext(RunEvents())
    optim, batch = config.optim, config.data.batch_size
    keys = recipe.log_keys(global_batch=batch, micro_batch=batch // t.env.world_size, dense_lr=optim.dense_lr,
                           sparse_lr=optim.sparse_lr, warmup_steps=optim.lr_warmup_steps,
                           max_seq_len=t.model_config.max_seq_len, precision=optim.precision, seed=config.loop.seed,
                           config_file=config_file or "torchrec-tpu train")
    return mlperf_log(config, t.env.world_size, t.train.samples, keys=keys)

