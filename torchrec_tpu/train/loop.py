"""The training loop: steps over a batch stream, logs scalars, evaluates on a held-out stream.

The loop knows nothing about how the model is sharded or where its parts run: it takes a module
returning ``(loss, (loss, logits, labels))`` for a Batch (TorchRec's ``DLRMTrain`` contract), an
optimizer, and re-iterable batch streams. Swapping the sparse part to SparseCore or the dense part
to the TPU device changes what is passed in, not this file. Another model (HSTU) passes its own
step function and evaluator; its batches have ``to(device)`` and count their samples in ``rows``
(a TorchRec Batch: its labels).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.optim import Optimizer
from torchrec.datasets.utils import Batch

from pipelines.progress import ProgressLine, eta_text, progress_bar
from pipelines.streams import abandoning, batches_from_row
from torchrec_tpu.rank_watch import collectives
from torchrec_tpu.train.divergence import DivergenceGuard
from torchrec_tpu.train.metrics import EvalForward, EvalResult, Evaluator, evaluate, model_outputs
from torchrec_tpu.train.run_events import RunEvents
from torchrec_tpu.train.scalars import ScalarLog

_log = logging.getLogger(__name__)
DENSE_BWD, OPTIMIZER = "dense_bwd", "optimizer"  # the eager step's profiler ranges (torchrec_tpu.profiling)
COLLECTIVES = "collectives"  # the profiler range of a step's collectives (DDP's all-reduce, HSTU's)


@dataclass(frozen=True)
class LoopPosition:
    """Where training stands in the data: this rank trained the first ``rows`` rows of its share
    of epoch ``epoch``. In rows, not batches, so a resume may change the batch size."""

    epoch: int = 0
    rows: int = 0


@dataclass(frozen=True)
class LoopOptions:
    epochs: int = 1
    max_steps: int = 0  # 0: no limit
    log_every: int = 20
    eval_every: int = 0  # 0: evaluate only at the end
    first_eval_step: int = 0  # no eval_every evaluation before this step (MLPerf DLRMv4's first evaluation point)
    eval_batch_rows: int = 0  # every evaluation batch zero-padded to this many rows, padding unscored (0: none)
    target_auc: float = 0.0  # stop at the first eval_every evaluation reaching it (0: no target)
    checkpoint_every: int = 0  # 0: no checkpoints during training
    progress: bool = True
    primary: bool = True  # this rank prints a line per evaluation and checkpoint (the others do not)
    world_size: int = 1  # samples/s counts every rank's batch (ranks step in lock-step)
    start_step: int = 0  # global step to resume from (a checkpoint's "step")
    start: LoopPosition = LoopPosition()  # where in the data that step left off
    learning_rates: str = ""  # the rates a divergence stop names (torchrec_tpu.train.divergence)


@dataclass(frozen=True)
class TrainResult:
    steps: int  # global step reached (including the steps before a resume)
    samples: int  # trained on in this run, over all ranks
    train_seconds: float  # wall time of the loop (input pipeline included), eval and checkpoints excluded
    final_train_loss: float  # mean over the last ``log_every`` steps
    eval: EvalResult
    position: LoopPosition  # where a run resuming from here continues
    first_step_seconds: float = 0.0  # this run's first step, input included (tracing / compiling happen there)
    test: EvalResult | None = None  # the test split's, scored once at the end (None: no test split)
    target_step: int | None = None  # the step whose evaluation reached --target-auc (None: not reached, or none)
    best_eval: tuple[int, EvalResult] | None = None  # (step, evaluation) of the best held-out AUC this run
    first_step_samples: int = 0  # trained on in this run's first step, over all ranks

    @property
    def samples_per_sec(self) -> float:
        """Over the whole loop, the first step (compiling) included."""
        return self.samples / self.train_seconds if self.train_seconds > 0 else 0.0

    @property
    def steady_samples_per_sec(self) -> float | None:
        """Over the steps after this run's first (which compiles); None with a single step."""
        seconds = self.train_seconds - self.first_step_seconds
        samples = self.samples - self.first_step_samples
        return samples / seconds if samples > 0 and seconds > 0 else None


StepFn = Callable[[nn.Module, Optimizer, Batch], torch.Tensor]
CheckpointFn = Callable[[int, LoopPosition], object]  # (global step, position after it) -> where it went
LearningRatesFn = Callable[[int], dict[str, float]]  # 1-based step -> scalars (rates applied)


def train_step(model: nn.Module, optimizer: Optimizer, batch: Batch, *,
               forward_context: Callable[[], ContextManager] = contextlib.nullcontext) -> torch.Tensor:
    """One forward/backward/update, op by op. Fused embedding optimizers update the tables in
    backward; ``optimizer.step()`` updates the dense parameters. The forward runs inside
    ``forward_context()`` (``--precision bf16``: autocast). (The profiler's phase ranges cost
    about a microsecond each when no profiler runs.)"""
    optimizer.zero_grad()
    with forward_context():
        loss, _ = model(batch)
    with record_function(DENSE_BWD):
        loss.backward()
    with record_function(OPTIMIZER):
        optimizer.step()
    return loss.detach()


def _batches(train: Iterable[Batch], options: LoopOptions) -> Iterator[tuple[LoopPosition, Batch]]:
    """(position after the batch, batch) from ``options.start`` to the end of the last epoch.

    Resuming mid-epoch seeks the stream to its row when it can (``iter_from_row``), else reads
    and drops the batches before it.
    """
    start = options.start
    for epoch in range(start.epoch, options.epochs):
        rows = start.rows if epoch == start.epoch else 0
        for batch in batches_from_row(train, rows):
            rows += batch_rows(batch)
            yield LoopPosition(epoch, rows), batch


def batch_rows(batch: Any) -> int:
    """The samples of ``batch``: its ``rows`` where it counts them (a sequence batch: its users),
    else its labels (a TorchRec Batch)."""
    rows = getattr(batch, "rows", None)
    return batch.labels.numel() if rows is None else rows


def _done(step: int, options: LoopOptions) -> bool:
    return bool(options.max_steps) and step >= options.max_steps


def _len(train: Iterable[Batch]) -> int | None:
    try:
        return len(train)  # type: ignore[arg-type]
    except TypeError:
        return None


def _total_steps(train: Iterable[Batch], options: LoopOptions) -> int | None:
    per_epoch = _len(train)
    if per_epoch is None:
        return options.max_steps or None
    total = per_epoch * options.epochs
    return min(total, options.max_steps) if options.max_steps else total


def run_training(
    model: nn.Module,
    optimizer: Optimizer,
    train: Iterable[Batch],
    held_out: Iterable[Batch],
    device: torch.device,
    log: ScalarLog,
    options: LoopOptions,
    step_fn: StepFn = train_step,
    checkpoint: CheckpointFn | None = None,
    learning_rates: LearningRatesFn | None = None,
    eval_forward: EvalForward = model_outputs,
    test: Iterable[Batch] | None = None,
    events: RunEvents = RunEvents(),
    evaluator: Evaluator | None = None,
) -> TrainResult:
    """Train over ``train`` (re-iterated per epoch), evaluate on ``held_out`` (and at the end on
    ``test``, logged as ``test/auc``, ``test/loss``); return a summary.

    ``checkpoint`` is called every ``options.checkpoint_every`` steps except the last (whose
    state the caller has when this returns). ``learning_rates(s)`` sets the rates of step ``s``
    (1-based) before it runs and returns them as scalars, logged at that step. ``eval_forward``
    runs the model on a held-out batch; ``evaluator``, where given, scores a whole split instead.
    ``events`` hears the run's timeline (:mod:`~torchrec_tpu.train.run_events`).
    """
    model.train()
    step, position = options.start_step, options.start
    total = _total_steps(train, options)
    bar = progress_bar(total=total, initial=options.start_step, desc="train", unit="step", enabled=options.progress)
    metrics = _MetricsWindow(log, options, total, bar)
    timeline = _Timeline(events, _len(train), metrics)
    evaluator = evaluator or functools.partial(evaluate, device=device, forward=eval_forward,
                                               batch_rows=options.eval_batch_rows)
    evaluations = _Evaluations(options, log, lambda split, at: _evaluate(model, split, at, evaluator, options),
                               timeline)
    stream = iter(()) if _done(step, options) else _batches(train, options)
    events.run_started(timeline.epoch_num(position))
    with bar, _closed(stream):
        for position, batch in stream:
            timeline.stepping(position, batch_rows(batch))
            rates = learning_rates(step + 1) if learning_rates else None
            with collectives(f"train step {step + 1} (embedding all_to_all, dense gradient all_reduce)"):
                loss = step_fn(model, optimizer, batch.to(device))
            step += 1
            if rates:
                log.log(step, rates)
            metrics.stepped(step, position.epoch, loss, batch_rows(batch) * options.world_size)
            if _stop_after(step, position, held_out, evaluations, metrics, checkpoint, total, options):
                break
    train_seconds = metrics.train_seconds()
    if step == options.start_step:
        raise ValueError(f"no batches to train on from step {options.start_step} (the training split is empty, "
                         "or a resumed run already reached --epochs / --max-steps)")
    result = evaluations.last if evaluations.due(step) else evaluations.held_out(held_out, step, position)
    timeline.finished(position, evaluations.target_step is not None)
    test_result = evaluations.logged(step, evaluations.run(test, step), "test") if test is not None else None
    return TrainResult(step, metrics.samples, train_seconds, metrics.final_loss(), result, position,
                       metrics.first_step_seconds, test_result, evaluations.target_step, evaluations.best,
                       metrics.first_step_samples)


def _stop_after(step: int, position: LoopPosition, held_out: Iterable[Batch], evaluations: _Evaluations,
                metrics: _MetricsWindow, checkpoint: CheckpointFn | None, total: int | None,
                options: LoopOptions) -> bool:
    """After step ``step`` (``position`` in the data): the evaluation and the checkpoint due then,
    outside the loop's time; whether training stops there (the held-out AUC reached
    ``--target-auc``, the same on every rank, or the step is the last of ``--max-steps``)."""
    if evaluations.due(step):
        with metrics.paused():
            evaluations.held_out(held_out, step, position)
        if evaluations.target_step is not None:
            return True
    if checkpoint and options.checkpoint_every and step % options.checkpoint_every == 0 and step != total:
        with metrics.paused():
            _save(checkpoint, step, position, metrics, options)
    return _done(step, options)


@contextlib.contextmanager
def _closed(stream: Iterator[Any]) -> Iterator[None]:
    """``stream`` closed on leaving: in lock-step (every rank stops its prefetching at the same
    batch) when the loop ends, abandoned when it fails (:func:`pipelines.streams.abandoning`)."""
    try:
        yield
    except BaseException:
        with abandoning():
            _close(stream)
        raise
    _close(stream)


def _close(stream: Iterator[Any]) -> None:
    close = getattr(stream, "close", None)
    if close is not None:
        close()


def _save(checkpoint: CheckpointFn, step: int, position: LoopPosition, metrics: _MetricsWindow,
          options: LoopOptions) -> None:
    metrics.read_pending()  # no checkpoint of a diverged step
    with collectives(f"the checkpoint save at step {step}"):
        saved = checkpoint(step, position)
    if options.primary:
        _log.info("checkpoint step %d: %s", step, saved)


class _MetricsWindow:
    """The training scalars: step losses read back lazily (every ``log_every`` steps, in one go)
    and checked for divergence there, samples/s over the steps since the last log (the first step,
    which compiles, counts in none), and the loop's own time, evaluation and checkpoints excluded (:meth:`paused`)."""

    def __init__(self, log: ScalarLog, options: LoopOptions, total: int | None, bar: Any) -> None:
        self.log, self.options, self.total, self.bar = log, options, total, bar
        self.pending: list[tuple[int, int, torch.Tensor]] = []  # (step, epoch, loss) not read back yet
        self.guard = DivergenceGuard(options.learning_rates, options.world_size)
        self.window_losses: list[float] = []
        self.recent_losses: collections.deque[float] = collections.deque(maxlen=options.log_every)
        self.samples = self.window_samples = 0
        self.first_step_seconds = self.paused_seconds = 0.0
        self.loop_start = self.window_start = time.perf_counter()
        self.first_step: int | None = None  # this run's first step (it compiles)
        self.first_step_samples = 0
        # off a terminal, a line at least every $TORCHREC_TPU_PROGRESS_SECONDS between --log-every lines
        self.lines = ProgressLine(_log.info, "train", total, unit="steps") if bar.disable and options.progress else None
        bar.set_postfix_str("compiling")  # the first step traces and compiles

    def stepped(self, step: int, epoch: int, loss: torch.Tensor, batch_samples: int) -> None:
        self.pending.append((step, epoch, loss.detach()))
        self.samples += batch_samples
        self.window_samples += batch_samples
        if not self.first_step_seconds:  # waits for the first step only: its time includes compiling,
            self.read_pending()  # which no samples/s point counts
            self.first_step_seconds = time.perf_counter() - self.loop_start
            self.first_step, self.first_step_samples = step, batch_samples
            self.window_samples, self.window_start = 0, time.perf_counter()
        if step % self.options.log_every == 0:
            self._log_window(step, epoch)
        elif self.lines is not None and self.lines.due():  # a long --log-every window: no loss read, no sync
            elapsed = time.perf_counter() - self.window_start
            steady = self.window_samples and elapsed > 0
            rate = f"{self.window_samples / elapsed:,.0f} samples/s" if steady else "compiling"
            self.lines.mark()
            _log.info("step %d/%d  epoch %d  %s%s", step, self.total, epoch, rate, self._eta(step))
        self.bar.update(1)

    def _eta(self, step: int) -> str:
        """``  ETA 4m12s`` at the pace of this run's steps after the first (which compiled); ``""``
        before there is one, or without a known last step."""
        if self.total is None or self.first_step is None or step <= self.first_step or self.total <= self.first_step:
            return ""
        steady = time.perf_counter() - self.loop_start - self.first_step_seconds - self.paused_seconds
        return "  " + eta_text(steady, (step - self.first_step) / (self.total - self.first_step))

    def _log_window(self, step: int, epoch: int) -> None:
        self.read_pending()
        self.recent_losses.extend(self.window_losses)
        elapsed = time.perf_counter() - self.window_start
        mean_loss = sum(self.window_losses) / len(self.window_losses)
        # a window of the first step alone has no rate: that step compiled
        rate = self.window_samples / elapsed if self.window_samples and elapsed > 0 else None
        self.log.log(step, {"train/loss": mean_loss, "train/epoch": epoch,
                            **({"train/samples_per_sec": rate} if rate is not None else {})})
        rate_text = "compiling" if rate is None else f"{rate:,.0f} samples/s"
        self.bar.set_postfix(loss=f"{mean_loss:.4f}", samples_s=rate_text.removesuffix(" samples/s"))
        if self.lines is not None:  # no bar (not a terminal): one line per --log-every
            self.lines.mark()
            _log.info("step %d/%d  epoch %d  loss %.4f  %s%s", step, self.total, epoch, mean_loss, rate_text,
                      self._eta(step) if rate is not None else "")
        self.window_losses, self.window_samples, self.window_start = [], 0, time.perf_counter()

    def read_pending(self) -> None:
        self.window_losses += self._read()

    def _read(self) -> list[float]:
        """The pending steps' losses (it waits for the steps to finish), checked by the guard
        (every rank reads at the same steps); ``pending`` emptied."""
        # read one by one: a device stack would compile a program per count of pending losses (tens of
        # ms each on the first window, the last one's and a resumed run's), a read costs microseconds
        values = [float(loss) for _, _, loss in self.pending]
        self.guard.check((step, epoch, value) for (step, epoch, _), value in zip(self.pending, values))
        self.pending.clear()
        return values

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (evaluation, a checkpoint) counts in neither samples/s nor train time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.window_start = time.perf_counter()
            self.paused_seconds += self.window_start - start

    def train_seconds(self) -> float:
        return time.perf_counter() - self.loop_start - self.paused_seconds

    def final_loss(self) -> float:
        """The mean loss of the last ``log_every`` steps, the steps since the last log included."""
        self.recent_losses.extend([*self.window_losses, *self._read()])
        return sum(self.recent_losses) / len(self.recent_losses)


def _evaluate(model: nn.Module, held_out: Iterable[Batch], step: int, evaluator: Evaluator,
              options: LoopOptions) -> EvalResult:
    """``held_out``'s evaluation; the primary says it starts, then how far it is every
    ``progress_interval`` seconds (a large split takes minutes)."""
    progress = None
    if options.primary:
        _log.info("evaluating the model after step %d", step)
        batches, line = _len(held_out), ProgressLine(_log.info, f"evaluation after step {step}")

        def progress(rows: int, done: int) -> None:
            line.update(rows, done / batches if batches else None)
    with collectives(f"the evaluation at step {step} (embedding all_to_all, metric all_gather)"):
        return evaluator(model, held_out, progress=progress)


class _Timeline:
    """Tells ``events`` where the loop is: epochs begun and ended, stretches of steps between
    evaluations, each evaluation, at fractional epochs (the share of an epoch's batches trained;
    whole epochs when the stream's length is unknown)."""

    def __init__(self, events: RunEvents, batches_per_epoch: int | None, metrics: _MetricsWindow) -> None:
        self.events, self.batches_per_epoch, self.metrics = events, batches_per_epoch, metrics
        self.batch_rows = 0  # rows of the run's first batch: an epoch is batches_per_epoch of them
        self.epoch: int | None = None  # the epoch being trained (None: none yet)
        self.in_steps = False

    def epoch_num(self, position: LoopPosition) -> float:
        if not self.batches_per_epoch or not self.batch_rows:
            return float(position.epoch)
        return position.epoch + min(1.0, position.rows / (self.batches_per_epoch * self.batch_rows))

    def stepping(self, position: LoopPosition, batch_rows: int) -> None:
        """A step on a batch of ``batch_rows`` rows, which ends at ``position``, is next."""
        self.batch_rows = self.batch_rows or batch_rows
        samples = self.metrics.samples
        if position.epoch != self.epoch:
            if self.epoch is not None:
                self.events.epoch_stopped(self.epoch, samples)
            self.epoch = position.epoch
            self.events.epoch_started(position.epoch, samples)
        if not self.in_steps:
            self.in_steps = True
            before = LoopPosition(position.epoch, position.rows - batch_rows)
            self.events.steps_started(self.epoch_num(before), samples)

    def evaluating(self, position: LoopPosition) -> float:
        """An evaluation at ``position`` is next: its fractional epoch."""
        epoch_num = self.epoch_num(position)
        if self.in_steps:
            self.in_steps = False
            self.events.steps_stopped(epoch_num, self.metrics.samples)
        return epoch_num

    def finished(self, position: LoopPosition, reached_target: bool) -> None:
        """Training and its last held-out evaluation are over."""
        epoch_num, samples = self.epoch_num(position), self.metrics.samples
        if self.epoch is not None:
            self.events.epoch_stopped(self.epoch, samples)
        self.events.run_stopped(epoch_num, samples, reached_target)


class _Evaluations:
    """The run's evaluations on their ``options.eval_every`` schedule: logged (TensorBoard and, on
    the primary, one console line each; the held-out ones also to ``timeline``), the latest and
    best held-out one and the step whose evaluation reached ``options.target_auc`` kept.
    ``run(split, step)`` evaluates a split."""

    def __init__(self, options: LoopOptions, log: ScalarLog,
                 run: Callable[[Iterable[Batch], int], EvalResult], timeline: _Timeline) -> None:
        self.options, self.log, self.run, self.timeline = options, log, run, timeline
        self.last: EvalResult | None = None
        self.best: tuple[int, EvalResult] | None = None
        self.target_step: int | None = None

    def due(self, step: int) -> bool:
        options = self.options
        return bool(options.eval_every) and step % options.eval_every == 0 and step >= options.first_eval_step

    def logged(self, step: int, result: EvalResult, split: str) -> EvalResult:
        self.log.log(step, result.scalars(split))
        if self.options.primary:
            _log.info("%s step %d: %s", split, step, result.describe())
        return result

    def held_out(self, held_out: Iterable[Batch], step: int, position: LoopPosition) -> EvalResult:
        """Evaluate the held-out (validation) split after the step that ended at ``position``, log
        it and keep score."""
        epoch_num = self.timeline.evaluating(position)
        samples = self.timeline.metrics.samples
        self.timeline.events.eval_started(epoch_num, samples)
        result = self.last = self.logged(step, self.run(held_out, step), "eval")
        self.timeline.events.eval_stopped(epoch_num, samples, result)
        if self.best is None or result.auc > self.best[1].auc:
            self.best = (step, result)
        if self.options.target_auc and self.target_step is None and result.auc >= self.options.target_auc:
            self.target_step = step
            if self.options.primary:
                _log.info("eval AUC %.5f at step %d reached --target-auc %s: stopping", result.auc, step,
                          self.options.target_auc)
        return result
