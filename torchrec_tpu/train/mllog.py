"""``train --mllog FILE``: the compliance log of the model's MLPerf benchmark (DLRM-DCNv2, DLRMv4),
written with MLCommons' ``mlperf-logging`` package (``mlperf_logging.mllog``), on rank 0 only.

:func:`mlperf_log` opens the file once the data is open and logs what is known before the model
is built (``cache_clear``, ``init_start``, the submission info and the hyperparameters of the
config); its :class:`MLPerfLog` then turns the training loop's events (:mod:`~torchrec_tpu.train.run_events`)
into MLPerf's: ``init_stop`` and ``run_start`` with ``train_samples``, ``epoch_*``, ``block_*``
(the stretches of steps between evaluations), ``eval_*`` with ``eval_accuracy`` (the held-out
AUC) and ``eval_samples``, and ``run_stop`` with status ``success`` when an evaluation reached
``--target-auc``, else ``aborted`` (also when the run fails). docs/MLPERF.md says how to check it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from pathlib import Path
from typing import Any, Iterator, Mapping

from mlperf_logging.mllog import constants as mlc
from mlperf_logging.mllog.mllog import MLLogger

from torchrec_tpu.host_cpu import cpu_model
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.metrics import EvalResult
from torchrec_tpu.train.model_kinds import MODEL_KINDS
from torchrec_tpu.train.optimizers import ADAGRAD_EPS
from torchrec_tpu.train.run_events import RunEvents

_ADAGRADS = ("adagrad", "rowwise_adagrad")
_loggers = itertools.count()  # one Python logger per log file


class MLPerfLog(RunEvents):
    """The loop's events as MLPerf's keys in ``mllogger``; ``train_samples``: samples in an epoch,
    all ranks (logged with ``run_start``)."""

    def __init__(self, mllogger: MLLogger, train_samples: int) -> None:
        self.mllogger, self.train_samples = mllogger, train_samples
        self.run_open = False
        self.eval_samples_logged = False

    def run_started(self, epoch_num: float) -> None:
        self.mllogger.end(mlc.INIT_STOP)
        self.mllogger.start(mlc.RUN_START)
        self.run_open = True
        self.mllogger.event(mlc.TRAIN_SAMPLES, self.train_samples)

    def epoch_started(self, epoch: int, samples: int) -> None:
        self.mllogger.start(mlc.EPOCH_START, metadata={mlc.EPOCH_NUM: epoch, mlc.SAMPLES_COUNT: samples})

    def epoch_stopped(self, epoch: int, samples: int) -> None:
        self.mllogger.end(mlc.EPOCH_STOP, metadata={mlc.EPOCH_NUM: epoch, mlc.SAMPLES_COUNT: samples})

    def steps_started(self, epoch_num: float, samples: int) -> None:
        self.mllogger.start(mlc.BLOCK_START, metadata={mlc.FIRST_EPOCH_NUM: epoch_num, mlc.SAMPLES_COUNT: samples})

    def steps_stopped(self, epoch_num: float, samples: int) -> None:
        self.mllogger.end(mlc.BLOCK_STOP, metadata={mlc.EPOCH_NUM: epoch_num, mlc.SAMPLES_COUNT: samples})

    def eval_started(self, epoch_num: float, samples: int) -> None:
        self.mllogger.start(mlc.EVAL_START, metadata={mlc.EPOCH_NUM: epoch_num, mlc.SAMPLES_COUNT: samples})

    def eval_stopped(self, epoch_num: float, samples: int, result: EvalResult) -> None:
        at = {mlc.EPOCH_NUM: epoch_num, mlc.SAMPLES_COUNT: samples}
        self.mllogger.event(mlc.EVAL_ACCURACY, result.auc, metadata=at)
        self.mllogger.end(mlc.EVAL_STOP, metadata=at)
        if not self.eval_samples_logged:  # MLPerf logs the held-out split's size once
            self.mllogger.event(mlc.EVAL_SAMPLES, result.samples, metadata=at)
            self.eval_samples_logged = True

    def run_stopped(self, epoch_num: float, samples: int, reached_target: bool) -> None:
        self._stop(mlc.SUCCESS if reached_target else mlc.ABORTED, {mlc.EPOCH_NUM: epoch_num,
                                                                    mlc.SAMPLES_COUNT: samples})

    def failed(self) -> None:
        """The run failed: ``run_stop`` ``aborted``, unless it has stopped (or never started)."""
        self._stop(mlc.ABORTED, {})

    def _stop(self, status: str, metadata: dict[str, Any]) -> None:
        if self.run_open:
            self.run_open = False
            # stack_offset 3: the line names who called run_stopped or failed
            self.mllogger.end(mlc.RUN_STOP, metadata={mlc.STATUS: status, **metadata}, stack_offset=3)


def hyperparameters(config: TrainConfig) -> dict[str, Any]:
    """MLPerf's hyperparameter keys -> this config's values (what the optimizers really run)."""
    optim = config.optim
    sparse, dense = MODEL_KINDS[config.model.kind].optimizers or (optim.sparse_optimizer, optim.dense_optimizer)
    names = {sparse, dense}
    values: dict[str, Any] = {
        mlc.GLOBAL_BATCH_SIZE: config.data.batch_size,
        mlc.GRADIENT_ACCUMULATION_STEPS: 1,
        mlc.SEED: config.loop.seed,
        mlc.OPT_NAME: names.pop() if len(names) == 1 else f"{sparse} (embeddings), {dense} (dense)",
        mlc.OPT_BASE_LR: optim.dense_lr,
        mlc.OPT_WEIGHT_DECAY: 0,
        mlc.OPT_LR_WARMUP_STEPS: optim.lr_warmup_steps,
        mlc.OPT_LR_DECAY_START_STEP: optim.lr_decay_start if optim.lr_decay_steps else 0,
        mlc.OPT_LR_DECAY_STEPS: optim.lr_decay_steps,
    }
    if optim.sparse_lr != optim.dense_lr:
        values["opt_embedding_base_learning_rate"] = optim.sparse_lr  # not an MLPerf key: one rate there
    if sparse in _ADAGRADS or dense in _ADAGRADS:
        values.update({mlc.OPT_ADAGRAD_LR_DECAY: 0, mlc.OPT_ADAGRAD_INITIAL_ACCUMULATOR_VALUE: 0,
                       mlc.OPT_ADAGRAD_EPSILON: ADAGRAD_EPS})
    return values


def default_platform(config: TrainConfig, world_size: int) -> str:
    """``--mllog-platform``'s default as MLPerf writes platforms (``8xNVIDIA H100``): ranks x the
    host's processor, then the engine."""
    return f"{world_size}x{cpu_model()} ({config.engine.kind} engine)"


@contextlib.contextmanager
def mlperf_log(config: TrainConfig, world_size: int, train_samples: int,
               keys: Mapping[str, Any] | None = None) -> Iterator[MLPerfLog]:
    """The loop's events logged to ``--mllog`` (the file replaced), its opening keys logged first:
    the submission, then ``keys`` (default: :func:`hyperparameters`); when the run fails after
    ``run_start``, ``run_stop`` says ``aborted``. ``train_samples``: samples in an epoch, all ranks.
    Only rank 0 opens one."""
    path = Path(config.loop.mllog)  # type: ignore[arg-type]
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    python_logger = logging.getLogger(f"{__name__}.file{next(_loggers)}")
    python_logger.propagate = False
    python_logger.setLevel(logging.INFO)
    python_logger.addHandler(handler)
    # each line's "file" and "lineno": where the loop reported the event (the caller of MLPerfLog's method)
    mllogger = MLLogger(logger=python_logger, default_stack_offset=2)
    loop = config.loop
    try:
        here = 1  # the lines logged here name this function
        mllogger.event(mlc.CACHE_CLEAR, False, stack_offset=here)  # nothing clears the host's file cache here
        mllogger.start(mlc.INIT_START, stack_offset=here)
        benchmark = MODEL_KINDS[config.model.kind].mlperf_benchmark
        keys = hyperparameters(config) if keys is None else keys
        for key, value in ((mlc.SUBMISSION_BENCHMARK, benchmark), (mlc.SUBMISSION_ORG, loop.mllog_org),
                           (mlc.SUBMISSION_DIVISION, loop.mllog_division),
                           (mlc.SUBMISSION_PLATFORM, loop.mllog_platform or default_platform(config, world_size)),
                           (mlc.SUBMISSION_STATUS, loop.mllog_status), *keys.items()):
            mllogger.event(key, value, stack_offset=here)
        events = MLPerfLog(mllogger, train_samples)
        try:
            yield events
        except BaseException:
            events.failed()
            raise
    finally:
        python_logger.removeHandler(handler)
        handler.close()
