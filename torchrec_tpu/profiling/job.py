"""``torchrec-tpu profile``: N training steps of the training job's model under the profilers.

The model, data, optimizers and the step itself are set up exactly as ``torchrec-tpu train`` does,
for either engine (its :class:`~torchrec_tpu.train.engines.Engine` and data modules): the same
``--dense-device`` / ``--sparse-backend`` resolution and the engine's own step function, so by
default the one compiled step program ``train`` runs. Warm-up steps run first, untraced (they
trace and compile that program, and let TorchRec create its lazy input dists, which the phase hooks
then find), then ``steps`` steps are traced, each marked for both profilers
(:func:`~torchrec_tpu.profiling.trace.traced_step`) with the step's ``train_step`` range and, inside
it, a range naming the program (:func:`~torchrec_tpu.train.engines.step_program_name`). The sparsecore
engine's input dist runs inside the step here (no prefetch thread: torch.profiler records only the
threads it was enabled on).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.autograd.profiler import record_function

from pipelines.progress import progress_bar
from sparsecore.limits import PartitionOverflowError
from torchrec_tpu.log_setup import configure_logging
from torchrec_tpu.profiling.phases import DATA, PhasedParquetReader, phase_ranges
from torchrec_tpu.profiling.summary import format_summary
from torchrec_tpu.profiling.trace import TraceFiles, profiling, program_range, traced_step
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.data import open_data
from torchrec_tpu.train.distributed import DistEnv, process_group
from torchrec_tpu.train.engines import EAGER_STEP, engine_for, step_program_name
from torchrec_tpu.train.engines.sparsecore_engine import overflow_with_flags
from torchrec_tpu.train.job import decide_layout, model_spec, use_rank_threads
from torchrec_tpu.train.memory_preflight import check_model_fits
from torchrec_tpu.train.model_kinds import MODEL_KINDS
from torchrec_tpu.train.streams import training_streams

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileResult:
    engine: str
    program: str  # the step program profiled, as the trace names it
    steps: int
    log_dir: Path
    files: TraceFiles
    summary: str

    def format(self) -> str:
        return "\n".join([
            self.summary,
            f"  engine          {self.engine}",
            f"  step            {self.program}",
            f"  tensorboard     tensorboard --logdir {self.log_dir}  (Profile tab; pip extra 'profile')",
            f"  xprof           xprof server --logdir {self.log_dir} --port 8791",
            f"  chrome trace    {self.files.chrome_trace}",
            f"  jax xplane      {self.files.xplane}",
        ])


def profile_training(
    config: TrainConfig, steps: int, warmup: int = 2, log_dir: str | Path | None = None,
    device: torch.device = torch.device("cpu"), top: int = 10,
) -> ProfileResult:
    """Run ``warmup`` + ``steps`` training steps, tracing the last ``steps``."""
    configure_logging("profile")
    if steps < 1 or warmup < 1:
        raise ValueError(f"need steps >= 1 and warmup >= 1, got steps={steps}, warmup={warmup}")
    log_dir = Path(log_dir) if log_dir else config.loop.resolved_log_dir() / "profile"
    torch.manual_seed(config.loop.seed)
    if MODEL_KINDS[config.model.kind].training != f"{__name__}:profile_training":  # a model's own setup
        return _profile_model(config, steps, warmup, log_dir, top)
    if config.data.in_memory_binary_criteo_path is not None:
        raise ValueError("profile reads Parquet (--data); --in-memory-binary-criteo-path is for train")
    with process_group() as env:
        use_rank_threads(config, env, "profile")  # as train: --dense-device auto's measurement depends on them
        return _profile_in(config, env, steps, warmup, log_dir, device, top)


def _profile_in(config: TrainConfig, env: DistEnv, steps: int, warmup: int, log_dir: Path, device: torch.device,
                top: int) -> ProfileResult:
    with open_data(config, env) as data:
        train = data.train
        reader = PhasedParquetReader(
            train.files, train.batch_size, train.table_sizes, train.schema,
            rank=env.rank, world_size=env.world_size, drop_last=env.world_size > 1,
            prefetch_row_groups=0, rows=train.rows,
        )
        spec = model_spec(config, data.schema.sparse, data.table_sizes, len(data.schema.dense))
        check_model_fits(spec, config.optim.sparse_optimizer, env.world_size)
        engine = engine_for(config)
        layout = decide_layout(engine, spec, env)  # train's decision, logged as train logs it
        built = time.perf_counter()
        model = engine.build_model(spec, env, device, layout)
        optimizer = engine.build_optimizer(model, layout)
        if env.is_primary:
            _log.info("model built in %.1f s", time.perf_counter() - built)
        stream, _ = training_streams(config, reader, reader, data.table_sizes, env.world_size, 0)
        stream = engine.wrap_batches(stream, model, env, device, background=False)
        batches = itertools.chain.from_iterable(itertools.repeat(stream))  # epochs as needed
        step_fn = engine.step_function(model, optimizer, layout)  # train's step: compiled where train's is
        program = step_program_name(step_fn)

        def step() -> None:
            batch = next(batches).to(device)
            with program_range(program):
                try:
                    step_fn(model, optimizer, batch)
                except PartitionOverflowError as error:  # no prefetch thread here to say it in flags
                    raise overflow_with_flags(config.data.batch_size, error) from None

        files = _trace(step, model, warmup, steps, log_dir, env.is_primary, config.loop.progress)
    return ProfileResult(config.engine.kind, program, steps, log_dir, files,
                         format_summary(files.profiler, steps, top))


def _trace(step: Callable[[], None], model: nn.Module, warmup: int, steps: int, log_dir: Path,
           primary: bool, progress: bool) -> TraceFiles:
    """``warmup`` untraced calls of ``step``, then ``steps`` traced ones, each marked, with the
    phase ranges on ``model``; the primary rank says when each part starts (the first step
    compiles; the trace is written at the end)."""
    model.train()
    if primary:
        _log.info("profile: %d warmup step(s), untraced; the first compiles", warmup)
    for _ in range(warmup):
        step()
    if primary:
        _log.info("profile: tracing %d step(s), then writing the trace to %s", steps, log_dir)
    with phase_ranges(model), profiling(log_dir) as files:
        for index in progress_bar(range(steps), desc="profile", unit="step", enabled=progress and primary):
            with traced_step(index):
                step()
    return files


def _profile_model(config: TrainConfig, steps: int, warmup: int, log_dir: Path, top: int) -> ProfileResult:
    """``--model hstu, dlrmv4``: train's setup and step of the model (its registry entry's
    ``training``: the same model, tables, devices and layout line), its training batches over as
    many passes as the steps need."""
    with MODEL_KINDS[config.model.kind].load("training")(config) as run:
        batches = itertools.chain.from_iterable(iter(run.train) for _ in itertools.count())

        def step() -> None:
            with record_function(DATA):
                batch = next(batches)
            with program_range(EAGER_STEP):
                run.step(batch)

        files = _trace(step, run.model, warmup, steps, log_dir, run.env.is_primary, config.loop.progress)
    engine = getattr(run, "engine", config.engine.kind)  # a model whose tables' engine is fixed names it
    return ProfileResult(engine, EAGER_STEP, steps, log_dir, files, format_summary(files.profiler, steps, top))
