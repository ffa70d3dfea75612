"""``torchrec-tpu train --model mlperf_dlrmv4``: MLPerf DLRMv4 (:mod:`~torchrec_tpu.hstu.dlrmv4`) trained
by the common loop (:func:`~torchrec_tpu.train.loop.run_training`) on MLPerf's recipe
(:mod:`~torchrec_tpu.hstu.dlrmv4_recipe`).

Data: ``--data synthetic`` (:class:`~pipelines.sequences.dlrmv4.DLRMv4Synthetic`, no real Yambda
here) at MLPerf's sizes, streamed by day as MLPerf's streaming mode does: ``--epochs N`` trains days
``T .. T + N - 1`` once each, in time order (MLPerf's 2,290,835,423 anchors over its 149 days, so
``N / 149`` of them; ``--limit-train-batches``: at most that many batches a day); day ``T + N`` is
the held-out set (MLPerf's 2,058,204 anchors; ``--limit-val-batches`` caps it). Evaluation every ``--eval-every`` steps,
or (0) on MLPerf's grid: 0.1% of the run's training samples, from the rules' first point; the run
stops at ``--target-auc``. The 11 tables: stock TorchRec's EmbeddingCollection with its
RowWiseAdagrad; the rest: Adam (betas 0.95/0.999, eps 1e-8), gradients clipped to norm 1.0; both
ramp from 0 over ``--lr-warmup-steps``. ``--precision bf16`` runs the forward in bfloat16.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, Iterator

import torch
from torch import nn
from torch.nn import functional
from torchrec.datasets.utils import Batch
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from pipelines.sequences.dlrmv4 import DLRMv4Synthetic
from torchrec_tpu.hstu import dlrmv4_recipe as recipe
from torchrec_tpu.hstu.dlrmv4 import MLPERF_ROWS, DLRMv4, DLRMv4Config, table_configs
from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.engines.precision import autocast
from torchrec_tpu.train.learning_rate import LearningRates, LRPolicy
from torchrec_tpu.train.loop import DENSE_BWD, OPTIMIZER, LoopOptions, TrainResult, run_training
from torchrec_tpu.train.memory_preflight import available_host_bytes, check_table_memory
from torchrec_tpu.train.mllog import mlperf_log
from torchrec_tpu.train.run_events import RunEvents
from torchrec_tpu.train.scalars import ScalarLog

_log = logging.getLogger(__name__)
FIRST_DAY = 30  # the first training day of the synthetic stream
TABLES_PREFIX = "model.embeddings."


def check_options(config: TrainConfig) -> None:
    """ConfigError for a ``--data`` it cannot read (the registry refuses the options it does not read)."""
    if config.data.source != "synthetic":
        raise ConfigError(f"--data {config.data.source!r}: --model mlperf_dlrmv4 reads --data synthetic only "
                          "(MLPerf's Yambda anchors are not on this host)")


def not_built(*args: object, **kwargs: object) -> None:
    """``profile`` and ``infer`` of ``--model mlperf_dlrmv4``: refused by name."""
    raise ConfigError("--model mlperf_dlrmv4: profile and infer are not built for it yet (train only, no checkpoints)")


class DLRMv4Train(nn.Module):
    """:class:`DLRMv4` under the loop's contract: ``forward(batch) -> (loss, (loss, logits, labels))``
    on a Batch whose ``sparse_features`` are the model's KJT."""

    def __init__(self, model: DLRMv4):
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.sparse_features).float()
        loss = functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


@dataclass(frozen=True)
class DayWindows:
    """Days ``first .. first + days - 1`` of ``data`` holding ``anchors`` in all (split evenly, MLPerf's
    sizes by default), in batches of ``global_batch`` (one process: a day's last one partial), at most ``limit``
    batches a day (0: all)."""

    data: DLRMv4Synthetic
    first: int
    days: int
    anchors: int
    global_batch: int
    limit: int = 0

    def day_anchors(self, day: int) -> int:
        """Anchors of day ``first + day``: ``floor((day + 1) A / days) - floor(day A / days)``."""
        return (day + 1) * self.anchors // self.days - day * self.anchors // self.days

    def _sizes(self, day: int) -> list[int]:
        anchors = self.day_anchors(day)
        whole, rest = divmod(anchors, self.global_batch)
        sizes = [self.global_batch] * whole + ([rest] if rest else [])
        return sizes[:self.limit] if self.limit else sizes

    def __len__(self) -> int:
        return sum(len(self._sizes(day)) for day in range(self.days))

    @property
    def samples(self) -> int:
        return sum(sum(self._sizes(day)) for day in range(self.days))

    def __iter__(self) -> Iterator[Batch]:
        for day in range(self.days):
            for index, size in enumerate(self._sizes(day)):
                kjt, labels = self.data.batch(self.first + day, index, size, MLPERF_ROWS)
                yield Batch(dense_features=torch.zeros(size, 0), sparse_features=kjt, labels=labels)


def clipped_step(precision: str, dense: list[nn.Parameter]):
    """The loop's step with the forward at ``precision`` and ``dense``'s gradients clipped to norm
    :data:`~torchrec_tpu.hstu.dlrmv4_recipe.CLIP_NORM` before the update."""

    def step(model: nn.Module, optimizer, batch: Batch) -> torch.Tensor:
        optimizer.zero_grad()
        with autocast("cpu", precision):
            loss, _ = model(batch)
        with torch.autograd.profiler.record_function(DENSE_BWD):
            loss.backward()
        torch.nn.utils.clip_grad_norm_(dense, recipe.CLIP_NORM)
        with torch.autograd.profiler.record_function(OPTIMIZER):
            optimizer.step()
        return loss.detach()

    return step


def optimizers(model: DLRMv4Train, dense_lr: float, sparse_lr: float) -> tuple[CombinedOptimizer, list[nn.Parameter]]:
    """MLPerf's optimizers of ``model``: Adam (betas 0.95/0.999, eps 1e-8, no weight decay) at
    ``dense_lr`` for the dense parameters (also returned, to clip), TorchRec's RowWiseAdagrad at
    ``sparse_lr`` for the tables; ``("dense", ...)`` then ``("sparse", ...)``."""
    named = dict(model.named_parameters())
    dense = {n: p for n, p in named.items() if not n.startswith(TABLES_PREFIX)}
    adam = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adam(ps, lr=dense_lr, betas=recipe.ADAM_BETAS,
                                                                     eps=recipe.ADAM_EPS, weight_decay=0.0))
    sparse = KeyedOptimizerWrapper({n: p for n, p in named.items() if n.startswith(TABLES_PREFIX)},
                                   lambda ps: RowWiseAdagrad(ps, lr=sparse_lr))
    return CombinedOptimizer([("dense", adam), ("sparse", sparse)]), list(dense.values())


@dataclass(frozen=True)
class DLRMv4Summary:
    """What a run reports."""

    primary: bool
    result: TrainResult
    seconds: float
    log_dir: Path

    def format(self) -> str:
        e = self.result.eval
        reached = f", --target-auc reached at step {self.result.target_step}" if self.result.target_step else ""
        return "\n".join([f"DLRMv4: {self.result.steps} steps in {self.seconds:.0f} s{reached}",
                          f"  eval (day T+1, {e.samples:,} anchors): {e.describe()}",
                          f"  TensorBoard     {self.log_dir}"])


def run_dlrmv4(config: TrainConfig, config_file: str = "", model_config: DLRMv4Config = DLRMv4Config(),
               world: DLRMv4Synthetic | None = None) -> DLRMv4Summary:
    """Train and evaluate DLRMv4 as ``config`` says (module docstring), one process; ``model_config``
    and the synthetic ``world`` (default: its defaults, histories up to the model's) set the sizes;
    ``config_file``: the YAML file given, for MLPerf's log."""
    check_options(config)
    tables = table_configs(model_config)
    check_table_memory([t.name for t in tables], [t.num_embeddings for t in tables], model_config.dim,
                       "rowwise_adagrad", 1, 1, available_host_bytes(),
                       remedy="the tables are capped at DLRMv4Config.max_rows rows each")
    torch.manual_seed(config.loop.seed)
    train_model = DLRMv4Train(DLRMv4(model_config))
    optim = config.optim
    optimizer, dense = optimizers(train_model, optim.dense_lr, optim.sparse_lr)
    adam, sparse = (optimizer.optimizers[i][1] for i in (0, 1))
    rates = LearningRates(LRPolicy(warmup_steps=optim.lr_warmup_steps), adam.param_groups, optim.dense_lr,
                          sparse.param_groups, optim.sparse_lr)
    data = world or DLRMv4Synthetic(max_history=model_config.max_history, seed=config.loop.seed)
    batch = config.data.batch_size
    days = config.loop.epochs
    train = DayWindows(data, FIRST_DAY, days, recipe.TRAIN_SAMPLES * days // recipe.TRAIN_DAYS, batch,
                       config.data.limit_train_batches)
    held_out = DayWindows(data, FIRST_DAY + days, 1, recipe.EVAL_SAMPLES, config.data.eval_batch_size,
                          config.data.limit_val_batches)
    train_samples = train.samples
    grid = not config.loop.eval_every
    options = LoopOptions(
        epochs=1, max_steps=config.loop.max_steps, log_every=config.loop.log_every,
        eval_every=recipe.eval_interval_steps(train_samples, batch) if grid else config.loop.eval_every,
        first_eval_step=recipe.first_eval_step(train_samples, batch) if grid else 0,
        target_auc=config.loop.target_auc, progress=config.loop.progress,
        learning_rates=f"--sparse-lr {optim.sparse_lr:g} (rowwise_adagrad), --dense-lr {optim.dense_lr:g} (adam)")
    log_dir = Path(config.loop.log_dir) if config.loop.log_dir else Path("runs") / time.strftime(
        "%Y%m%d-%H%M%S", time.gmtime())
    _log.info("training layout: DLRMv4 (11 tables of %d rows at most, dim %d, sequence %d) on the host's "
              "TorchRec EmbeddingCollection, STU stack on cpu; days %d-%d, evaluation every %d steps from step %d",
              model_config.max_rows, model_config.dim, model_config.max_seq_len, FIRST_DAY,
              FIRST_DAY + config.loop.epochs - 1, options.eval_every, options.first_eval_step)
    started = time.perf_counter()
    with ScalarLog(log_dir, True) as scalars, _events(config, train_samples, model_config, config_file) as events:
        result = run_training(train_model, optimizer, train, held_out, torch.device("cpu"), scalars, options,
                              step_fn=clipped_step(optim.precision, dense), learning_rates=rates.at, events=events)
    return DLRMv4Summary(True, result, time.perf_counter() - started, log_dir)


def _events(config: TrainConfig, train_samples: int, model_config: DLRMv4Config,
            config_file: str) -> ContextManager[RunEvents]:
    """MLPerf's dlrmv4 log with ``--mllog``, else no one hears the loop's events."""
    if config.loop.mllog is None:
        return contextlib.nullcontext(RunEvents())
    optim = config.optim
    keys = recipe.log_keys(global_batch=config.data.batch_size, micro_batch=config.data.batch_size,
                           dense_lr=optim.dense_lr, sparse_lr=optim.sparse_lr, warmup_steps=optim.lr_warmup_steps,
                           max_seq_len=model_config.max_seq_len, precision=optim.precision, seed=config.loop.seed,
                           config_file=config_file or "torchrec-tpu train")
    return mlperf_log(config, 1, train_samples, keys=keys)
