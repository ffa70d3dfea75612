"""What the jobs log, and the third-party noise they keep out of it.

:func:`configure_logging` runs in every process that runs a job: in the CLI before a subcommand
starts, where a job starts from Python (``run_job``, ``profile_training``, ``run_inference``; a
second call changes nothing), and in every Ray worker of a job (:func:`worker_setup`, Ray's
``worker_process_setup_hook``). The
project's loggers print INFO lines as they are on stdout (progress, where a run resumed) and
warnings as ``torchrec-tpu CMD: warning: ...`` on stderr. Silenced, as they say the same on every
run and nothing a user can act on:

* torch.fx's "is_fx_tracing will return true for both fx.symbolic_trace and torch.export" (TorchRec
  calls ``is_fx_tracing``);
* fbgemm_gpu's lines on import, through the root logger: "Successfully loaded: '...so'" per
  library, and its version-table note (ANSI-coloured);
* TorchRec's planner stats table and DMP details at INFO, and the ``broadcast_buffers``
  FutureWarning its DMP triggers (ours passes ``forward_sync_buffers``);
* JAX's "Unable to initialize backend 'tpu': ... libtpu.so not found" on a host without a TPU and
  its compilation cache's "Resetting cache at <empty>.";
* Ray's colour codes around the lines its workers print, when stdout is not a terminal
  (``RAY_COLOR_PREFIX=0``, read by the Ray driver), Ray Data's execution plans
  (``RAY_DATA_LOG_LEVEL=WARNING``) and its "Progress bars disabled" note, Ray Train's
  autoscaling-request tracebacks on a busy machine, its per-report ``TrainingReport(...)`` lines
  and its worker-group lines (its ``LoggingConfig``, :mod:`torchrec_tpu.train.ray_train`).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

WORKER_SETUP = "torchrec_tpu.log_setup.worker_setup"  # Ray's worker_process_setup_hook for the jobs
PROJECT_LOGGERS = ("torchrec_tpu", "pipelines")  # the jobs'; the libraries below them log warnings only
QUIET_LOGGERS = {
    "torch.fx._symbolic_trace": logging.ERROR,
    "jax._src.xla_bridge": logging.WARNING,
    "jax._src.compilation_cache": logging.WARNING,  # "Resetting cache at <empty>."
    "torchrec": logging.WARNING,  # the engine=torchrec planner's stats table, lookup and DMP details
    "ray.data._internal.progress": logging.ERROR,  # "Progress bars disabled"
}
# Ray Train's autoscaling client logs a warning with a 17-line traceback whenever a resource request
# times out on a busy machine ("safe to ignore"). Its controller's logging setup resets the levels
# of the loggers below ray.train, so a filter (which it keeps) drops these.
RAY_TRAIN_AUTOSCALING = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"
# Ray Train's per-report INFO line ("Reporting training result 1: TrainingReport(...)"): its logger
# is named by its file's path (below Ray's package directory), found without importing it
RAY_TRAIN_REPORTS = ("train", "v2", "_internal", "execution", "context.py")
# Ray workers log INFO through the root logger: the libraries' details stay out of the job's output.
WORKER_QUIET_LOGGERS = {name: logging.WARNING for name in ("torch_tpu", "sparsecore", "xla_cache")}


class _DropFbgemmImportLines(logging.Filter):
    """fbgemm_gpu's import-time root-logger records below ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and "fbgemm_gpu" in record.pathname and record.levelno < logging.ERROR)


class _Below(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


class _AtLeast(_Below):
    def filter(self, record: logging.LogRecord) -> bool:
        return not super().filter(record)


class _LowerLevelFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return super().format(logging.makeLogRecord({**record.__dict__, "levelname": record.levelname.lower()}))


class _StdStream(logging.StreamHandler):
    """A handler on ``sys.stdout`` / ``sys.stderr`` as they are when a line is written (a test's
    capture, a redirect set up later)."""

    def __init__(self, which: str) -> None:
        self._which = which
        super().__init__()
        self.set_name(_HANDLER_NAME)

    @property
    def stream(self):  # noqa: D102
        return getattr(sys, self._which)

    @stream.setter
    def stream(self, _value) -> None:
        pass


_HANDLER_NAME = "torchrec-tpu"


def configure_logging(command: str = "") -> None:
    """The module docstring's setup; a second call changes nothing. The project's lines do not
    also reach handlers on the root logger (a library's ``basicConfig``, Ray workers')."""
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    autoscaling = logging.getLogger(RAY_TRAIN_AUTOSCALING)
    if not any(isinstance(f, _AtLeast) for f in autoscaling.filters):
        autoscaling.addFilter(_AtLeast(logging.ERROR))
    root = logging.getLogger()
    if not any(isinstance(f, _DropFbgemmImportLines) for f in root.filters):
        root.addFilter(_DropFbgemmImportLines())
    # TorchRec's DMP (engine=torchrec) still passes DDP the deprecated broadcast_buffers
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
    # torchmetrics gathering ranks' unequal prediction counts (the held-out rows' remainder) indexes with a list
    warnings.filterwarnings("ignore", message="Using a non-tuple sequence for multidimensional indexing",
                            category=UserWarning, module=r"torchmetrics\.")
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")  # read by Ray Data in the Ray processes started later
    info = _StdStream("stdout")
    info.addFilter(_Below(logging.WARNING))
    info.setFormatter(logging.Formatter("%(message)s"))
    warning_lines = _StdStream("stderr")
    warning_lines.setLevel(logging.WARNING)
    prefix = f"torchrec-tpu {command}".strip()
    warning_lines.setFormatter(_LowerLevelFormatter(f"{prefix}: %(levelname)s: %(message)s"))
    for name in PROJECT_LOGGERS:
        logger = logging.getLogger(name)
        logger.propagate = False
        if any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
            continue
        logger.setLevel(logging.INFO)
        logger.addHandler(info)
        logger.addHandler(warning_lines)


def worker_setup() -> None:
    """Ray's ``worker_process_setup_hook`` for the jobs' workers: the same logging as the driver,
    and the worker pinned to its job's Ray instance (:func:`pipelines.ray_data.pin_ray_address`)."""
    from pipelines.ray_data import pin_ray_address

    configure_logging()
    for name, level in WORKER_QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    import ray

    logging.getLogger(str(Path(ray.__file__).parent.joinpath(*RAY_TRAIN_REPORTS))).setLevel(logging.WARNING)
    pin_ray_address()


def say_loading(command: str) -> None:
    """Lines around a job's heavy imports (torch, then TorchRec, FBGEMM and JAX: a minute or more
    on a busy host, where the job said nothing yet), from the first rank only (``RANK``,
    torchrun's); imports torch itself, between the two lines."""
    say = logging.getLogger("torchrec_tpu.jobs").info if os.environ.get("RANK", "0") == "0" else None
    if say:
        say("%s: loading torch", command)
    import torch  # noqa: F401

    if say:
        say("%s: loading TorchRec, FBGEMM and JAX", command)
