"""The training loop: steps over a batch stream, logs scalars, evaluates on a held-out stream.

The loop knows nothing about how the model is sharded or where its parts run: it takes a module
returning ``(loss, (loss, logits, labels))`` for a Batch (TorchRec's ``DLRMTrain`` contract), an
optimizer, and re-iterable batch streams. Swapping the sparse part to SparseCore or the dense part
to the TPU device changes what is passed in, not this file.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.optim import Optimizer
from torchrec.datasets.utils import Batch

from pipelines.progress import progress_bar
from pipelines.streams import batches_from_row
from torchrec_tpu.train.metrics import EvalForward, EvalResult, evaluate, model_outputs
from torchrec_tpu.train.rank_watch import collectives
from torchrec_tpu.train.scalars import ScalarLog

_log = logging.getLogger(__name__)
DENSE_BWD, OPTIMIZER = "dense_bwd", "optimizer"  # the eager step's profiler ranges (torchrec_tpu.profiling)


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
    eval_batch_rows: int = 0  # every evaluation batch zero-padded to this many rows, padding unscored (0: none)
    target_auc: float = 0.0  # stop at the first eval_every evaluation reaching it (0: no target)
    checkpoint_every: int = 0  # 0: no checkpoints during training
    progress: bool = True
    primary: bool = True  # this rank prints a line per evaluation and checkpoint (the others do not)
    world_size: int = 1  # samples/s counts every rank's batch (ranks step in lock-step)
    start_step: int = 0  # global step to resume from (a checkpoint's "step")
    start: LoopPosition = LoopPosition()  # where in the data that step left off


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

    @property
    def samples_per_sec(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds > 0 else 0.0


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
            rows += batch.labels.numel()
            yield LoopPosition(epoch, rows), batch


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
) -> TrainResult:
    """Train over ``train`` (re-iterated per epoch), evaluate on ``held_out`` (and at the end on
    ``test``, logged as ``test/auc``, ``test/loss``); return a summary.

    ``checkpoint`` is called every ``options.checkpoint_every`` steps except the last (whose
    state the caller has when this returns). ``learning_rates(s)`` sets the rates of step ``s``
    (1-based) before it runs and returns them as scalars, logged at that step. ``eval_forward``
    runs the model on a held-out batch.
    """
    model.train()
    step, samples = options.start_step, 0
    position = options.start
    total = _total_steps(train, options)
    paused_seconds = 0.0  # evaluation and checkpoints
    window_losses: list[float] = []
    pending: list[tuple[int, int, torch.Tensor]] = []  # (step, epoch, loss) not read back yet
    recent_losses: collections.deque[float] = collections.deque(maxlen=options.log_every)
    window_samples, window_start = 0, time.perf_counter()
    bar = progress_bar(total=total, initial=options.start_step, desc="train", unit="step", enabled=options.progress)
    bar.set_postfix_str("compiling")  # the first step traces and compiles
    loop_start = time.perf_counter()
    first_step_seconds = 0.0
    evaluations = _Evaluations(options)
    with bar:
        batches = () if _done(step, options) else _batches(train, options)
        for position, batch in batches:
            epoch = position.epoch
            rates = learning_rates(step + 1) if learning_rates else None
            with collectives(f"train step {step + 1} (embedding all_to_all, dense gradient all_reduce)"):
                loss = step_fn(model, optimizer, batch.to(device))
            pending.append((step, epoch, loss.detach()))  # read every log_every steps, not each step
            step += 1
            if rates:
                log.log(step, rates)
            batch_samples = batch.labels.numel() * options.world_size
            samples += batch_samples
            window_samples += batch_samples
            if not first_step_seconds:  # waits for the first step only: its time includes compiling,
                window_losses += _read_losses(pending)  # which no samples/s point counts
                first_step_seconds = time.perf_counter() - loop_start
                window_samples, window_start = 0, time.perf_counter()
            if step % options.log_every == 0:
                window_losses += _read_losses(pending)
                recent_losses.extend(window_losses)
                elapsed = time.perf_counter() - window_start
                mean_loss = sum(window_losses) / len(window_losses)
                # a window of the first step alone has no rate: that step compiled
                rate = window_samples / elapsed if window_samples and elapsed > 0 else None
                log.log(step, {"train/loss": mean_loss, "train/epoch": epoch,
                               **({"train/samples_per_sec": rate} if rate is not None else {})})
                rate_text = "compiling" if rate is None else f"{rate:,.0f} samples/s"
                bar.set_postfix(loss=f"{mean_loss:.4f}", samples_s=rate_text.removesuffix(" samples/s"))
                if bar.disable and options.progress:  # no bar (not a terminal): one line per --log-every
                    _log.info("step %d/%d  epoch %d  loss %.4f  %s", step, total, epoch, mean_loss, rate_text)
                window_losses, window_samples, window_start = [], 0, time.perf_counter()
            bar.update(1)
            if options.eval_every and step % options.eval_every == 0:
                eval_start = time.perf_counter()
                result = evaluations.held_out(log, step, _evaluate(model, held_out, device, step, eval_forward,
                                                                   options))
                window_start = time.perf_counter()
                paused_seconds += window_start - eval_start
                if evaluations.target_step is not None:  # the global AUC: every rank stops
                    if options.primary:
                        _log.info("eval AUC %.5f at step %d reached --target-auc %s: stopping", result.auc, step,
                                  options.target_auc)
                    break
            if checkpoint and options.checkpoint_every and step % options.checkpoint_every == 0 \
                    and step != total:
                save_start = time.perf_counter()
                window_losses += _read_losses(pending)  # no checkpoint of a NaN step
                with collectives(f"the checkpoint save at step {step}"):
                    saved = checkpoint(step, position)
                if options.primary:
                    _log.info("checkpoint step %d: %s", step, saved)
                window_start = time.perf_counter()
                paused_seconds += window_start - save_start
            if _done(step, options):
                break
    train_seconds = time.perf_counter() - loop_start - paused_seconds
    recent_losses.extend([*window_losses, *_read_losses(pending)])  # the steps since the last log
    if step == options.start_step:
        raise ValueError(
            f"no batches to train on from step {options.start_step} (the training split is empty, "
            "or a resumed run already reached --epochs / --max-steps)"
        )
    if not (options.eval_every and step % options.eval_every == 0):  # else just evaluated
        result = evaluations.held_out(log, step, _evaluate(model, held_out, device, step, eval_forward, options))
    test_result = None
    if test is not None:
        test_result = evaluations.logged(log, step, _evaluate(model, test, device, step, eval_forward, options),
                                         "test")
    final_loss = sum(recent_losses) / len(recent_losses)
    return TrainResult(step, samples, train_seconds, final_loss, result, position, first_step_seconds, test_result,
                       evaluations.target_step, evaluations.best)


def _read_losses(pending: list[tuple[int, int, torch.Tensor]]) -> list[float]:
    """The losses of ``pending`` steps as floats (it waits for the steps to finish), and ``pending``
    emptied. A NaN stops training: within ``log_every`` steps of the step it shows in."""
    # read one by one: a device stack would compile a program per count of pending losses (tens of
    # ms each on the first window, the last one's and a resumed run's), a read costs microseconds
    values = [float(loss) for _, _, loss in pending]
    for (step, epoch, _), value in zip(pending, values):
        if value != value:
            raise FloatingPointError(f"training loss is NaN at step {step} (epoch {epoch})")
    pending.clear()
    return values


def _evaluate(model: nn.Module, held_out: Iterable[Batch], device: torch.device, step: int,
              forward: EvalForward, options: LoopOptions) -> EvalResult:
    with collectives(f"the evaluation at step {step} (embedding all_to_all, metric all_gather)"):
        return evaluate(model, held_out, device, forward, options.eval_batch_rows)


class _Evaluations:
    """The run's evaluations: logged (TensorBoard and, on the primary, one console line each), the
    best held-out one and the step whose evaluation reached ``options.target_auc`` kept."""

    def __init__(self, options: LoopOptions) -> None:
        self.options = options
        self.best: tuple[int, EvalResult] | None = None
        self.target_step: int | None = None

    def logged(self, log: ScalarLog, step: int, result: EvalResult, split: str) -> EvalResult:
        log.log(step, {f"{split}/auc": result.auc, f"{split}/loss": result.loss, f"{split}/accuracy": result.accuracy})
        if self.options.primary:
            _log.info("%s step %d: %s", split, step, result.describe())
        return result

    def held_out(self, log: ScalarLog, step: int, result: EvalResult) -> EvalResult:
        """Log an evaluation of the held-out (validation) split and keep score."""
        self.logged(log, step, result, "eval")
        if self.best is None or result.auc > self.best[1].auc:
            self.best = (step, result)
        if self.options.target_auc and self.target_step is None and result.auc >= self.options.target_auc:
            self.target_step = step
        return result
