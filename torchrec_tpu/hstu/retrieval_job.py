"""``torchrec-tpu train --model hstu --task retrieval``: the HSTU paper's retrieval experiment as
generative-recommenders' ``research/trainer/train.py`` runs it, through the common training loop.

- Data (``--data``): a MovieLens ratings file (``ratings.dat``, or CSV; a directory holding
  ``ratings.dat``) or ``synthetic``. Each user's ratings by time; users with fewer than 3 dropped.
- Training: each user's items but the last (the paper code's ``ignore_last_n=1``), the latest
  ``max_history + 1``; the output at every event is trained to score the next item, sampled softmax
  (temperature 0.05) against ``--random-negatives`` ids of the catalog and ``--in-batch-negatives``
  of the batch's distinct ids (the paper's MovieLens configs: 128 random, none in-batch). AdamW
  (betas 0.9 / 0.98, no weight decay) at ``--dense-lr`` on every parameter, the item table included.
- Evaluation (every ``--eval-every`` steps and at the end): each user's last item, ranked among
  every item of the catalog (the items rated in the data) from the output at the item before it,
  the history the model saw left out: HR@10/50/200, NDCG@10 and MRR
  (:mod:`~torchrec_tpu.hstu.retrieval_metrics`) in the console, TensorBoard and the summary.

Checkpoints (``--checkpoint-every``, a last one at the end) and ``--resume`` as the ranking jobs
have them. One process on CPU: several ranks, ``profile`` and ``infer`` are not built for it yet.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchrec.optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper

from pipelines.sequences import read_movielens, synthetic_events
from pipelines.streams import BatchStream
from torchrec_tpu.hstu.retrieval import (
    TEMPERATURE,
    LeaveOneOut,
    leave_one_out,
    sample_negatives,
    sampled_softmax_loss,
    target_ranks_over,
)
from torchrec_tpu.hstu.retrieval_metrics import METRICS, retrieval_metrics
from torchrec_tpu.hstu.retrieval_model import RetrievalBatch, RetrievalConfig, RetrievalHSTU
from torchrec_tpu.train.checkpoint.dirs import new_run_id, run_id_of
from torchrec_tpu.train.checkpoint.hstu_files import HSTU_META, find_hstu_checkpoint, is_legacy
from torchrec_tpu.train.checkpoint.manifest import CheckpointError
from torchrec_tpu.train.checkpoint.store import load_checkpoint, open_checkpoint, restore_rng
from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.distributed import DistEnv
from torchrec_tpu.train.engines.precision import autocast
from torchrec_tpu.train.job import JobHooks, ModelCheckpoints, loop_options, run_dirs, use_rank_threads
from torchrec_tpu.train.loop import LoopPosition, TrainResult, run_training
from torchrec_tpu.train.scalars import ScalarLog
from torchrec_tpu.train.streams import LimitedBatches

_log = logging.getLogger(__name__)
SYNTHETIC = {"users": 2000, "items": 500, "events_per_user": 30, "seed": 1}
ADAMW_BETAS = (0.9, 0.98)  # the paper code's optimizer: AdamW, weight decay 0 in its MovieLens configs
MIN_EVENTS = 3  # a training sequence of two items (one next-item target) and the held-out item


@dataclass(frozen=True)
class RetrievalData:
    """Each user's ratings split leave-one-out; ``catalog``: the distinct item ids (what is ranked)."""

    splits: LeaveOneOut
    catalog: torch.Tensor
    source: str

    @property
    def item_rows(self) -> int:
        return int(self.catalog.max()) + 1

    def sequences(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each user's items in time order and their times: the history and the held-out item."""
        history, times = self.splits.history("test"), self.splits.history_times("test")
        return ([np.append(h, t) for h, t in zip(history, self.splits.test)],
                [np.append(h, t) for h, t in zip(times, self.splits.test_time)])


def open_retrieval_data(source: str) -> RetrievalData:
    """The users of ``--data`` (module docstring); ConfigError when none has :data:`MIN_EVENTS` ratings."""
    if source == "synthetic":
        events = synthetic_events(**SYNTHETIC)
    elif source == "sample":
        raise ConfigError("--data sample with --task retrieval: the bundled MovieLens sample is 200 ratings of 193 "
                          f"users, none with the {MIN_EVENTS} a leave-one-out split needs; give a MovieLens ratings "
                          "file (ratings.dat of ml-1m, or a CSV) or --data synthetic")
    else:
        path = Path(source)
        path = path / "ratings.dat" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"--data {source}: no MovieLens ratings file there (ratings.dat, or a CSV)")
        events = read_movielens(path)
    splits = leave_one_out(events.user, events.item, events.timestamp)
    if splits.users.size == 0:
        raise ConfigError(f"--data {source}: no user has the {MIN_EVENTS} ratings a leave-one-out split needs")
    return RetrievalData(splits, torch.from_numpy(np.unique(events.item)), events.source)


def sequence_batch(items: list[np.ndarray], times: list[np.ndarray], users: np.ndarray,
                   max_history: int) -> RetrievalBatch:
    """The batch of ``users`` (indices into ``items``/``times``): each sequence's latest
    ``max_history`` events but the last as inputs, the event after each as its next item; the
    inputs are what the ranking leaves out (the paper code's ``past_ids``)."""
    seqs = [items[u][-max_history - 1:] for u in users]
    stamps = [times[u][-max_history - 1:] for u in users]
    lengths = np.array([s.size - 1 for s in seqs], dtype=np.int64)
    seen = np.full((len(seqs), int(lengths.max(initial=0))), -1, dtype=np.int64)
    for row, s in enumerate(seqs):
        seen[row, :s.size - 1] = s[:-1]

    def cat(parts: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts).astype(np.int64)) if parts else torch.zeros(0, dtype=torch.int64)

    return RetrievalBatch(torch.from_numpy(np.r_[0, np.cumsum(lengths)].astype(np.int64)),
                          cat([s[:-1] for s in seqs]), cat([s[:-1] for s in stamps]), cat([s[1:] for s in seqs]),
                          cat([s[1:] for s in stamps]), torch.from_numpy(seen))


class UserBatches(BatchStream):
    """Batches of ``local_batch`` users' sequences (:func:`sequence_batch`; the job runs in one
    process); with ``shuffle_seed`` each pass (epoch, the first being ``epoch``) is in a new order,
    as the paper's loader shuffles; ``iter_from_row`` resumes a pass at a row."""

    def __init__(self, items: list[np.ndarray], times: list[np.ndarray], local_batch: int, max_history: int,
                 shuffle_seed: int | None = None, epoch: int = 0) -> None:
        self.items, self.times, self.local_batch, self.max_history = items, times, local_batch, max_history
        self.shuffle_seed, self.epoch = shuffle_seed, epoch

    def __len__(self) -> int:
        return math.ceil(len(self.items) / self.local_batch)

    def __iter__(self) -> Iterator[RetrievalBatch]:
        return self.iter_from_row(0)

    def iter_from_row(self, row: int) -> Iterator[RetrievalBatch]:
        order = np.arange(len(self.items))
        if self.shuffle_seed is not None:
            order = np.random.default_rng((self.shuffle_seed, self.epoch)).permutation(order)
        self.epoch += 1
        return (sequence_batch(self.items, self.times, order[start:start + self.local_batch], self.max_history)
                for start in range(row, order.size, self.local_batch))


@dataclass(frozen=True)
class RetrievalEval:
    """An evaluation: HR@K, NDCG@K and MRR (``metrics``) over ``samples`` users. ``auc`` and ``ne``
    are NaN: retrieval ranks items (``--target-auc`` is refused with it)."""

    metrics: dict[str, float]
    samples: int
    auc: float = float("nan")
    ne: float = float("nan")

    def describe(self) -> str:
        """``HR@10 0.2100, HR@50 ..., NDCG@10 0.1100, MRR 0.0900 (6,040 users)``."""
        named = ", ".join(f"{name.upper()} {value:.4f}" for name, value in self.metrics.items())
        return f"{named} ({self.samples:,} users)"

    def scalars(self, split: str = "eval") -> dict[str, float]:
        """``<split>/hr@10``, ``<split>/ndcg@10``, ``<split>/mrr``, ..."""
        return {f"{split}/{name}": value for name, value in self.metrics.items()}


@torch.no_grad()
def evaluate(model: RetrievalHSTU, batches: Iterable[RetrievalBatch], catalog: torch.Tensor, precision: str,
             limit: int = 0, progress: Callable[[int, int], None] | None = None) -> RetrievalEval:
    """The metrics of ``batches``' first ``limit`` batches (0: all), each user's target ranked
    among ``catalog`` from the query at the user's last event."""
    model.eval()
    ranks = []
    for i, batch in enumerate(batches):
        if limit and i >= limit:
            break
        with autocast("cpu", precision):
            queries = model(batch)[batch.last]
        ranks.append(target_ranks_over(queries, model.items.weight, batch.next_ids[batch.last], batch.seen, catalog))
        if progress is not None:
            progress(sum(r.numel() for r in ranks), i + 1)
    model.train()
    if not ranks:
        raise ValueError("retrieval evaluation: no users to rank")
    users = torch.cat(ranks)
    return RetrievalEval(retrieval_metrics(users), users.numel())


@dataclass(frozen=True)
class Negatives:
    """The sampled softmax's negatives: ``in_batch`` of the batch's distinct ids, ``random`` of ``catalog``."""

    catalog: torch.Tensor
    in_batch: int
    random: int

    def of(self, batch: RetrievalBatch) -> torch.Tensor:
        pool = torch.unique(torch.cat([batch.ids, batch.next_ids]))
        return sample_negatives(batch.next_ids, pool, self.catalog, self.in_batch, self.random)


def train_step(model: RetrievalHSTU, optimizer: torch.optim.Optimizer, batch: RetrievalBatch, negatives: Negatives,
               precision: str) -> torch.Tensor:
    """One step: every event's output against its next item (module docstring); the loss."""
    with autocast("cpu", precision):
        queries = model(batch)
    loss = sampled_softmax_loss(queries.float(), batch.next_ids, negatives.of(batch), model.items.weight, TEMPERATURE)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


@dataclass(frozen=True)
class RetrievalSummary:
    """What a run reports; ``model`` is the trained encoder (for a Python caller)."""

    primary: bool
    result: TrainResult
    seconds: float
    log_dir: Path
    checkpoint: Path
    model: RetrievalHSTU
    data: RetrievalData

    def format(self) -> str:
        r = self.result
        steady = r.steady_samples_per_sec
        rate = f"{steady:,.0f} users/s steady (after the first step)" if steady else "one step, no steady figure"
        return "\n".join([f"HSTU retrieval: {r.steps} steps in {self.seconds:.0f} s ({self.data.source}, "
                          f"{self.data.catalog.numel():,} items)",
                          f"  last item, all items ranked: {r.eval.describe()}",
                          f"  throughput      {rate}",
                          f"  TensorBoard     {self.log_dir}",
                          f"  checkpoint      {self.checkpoint}"])


def run_retrieval(config: TrainConfig) -> RetrievalSummary:
    """Train and evaluate as ``config`` says (module docstring), checkpointing as the loop's options say."""
    started = time.perf_counter()
    env = DistEnv(rank=0, world_size=1, local_world_size=1)
    use_rank_threads(config, env, "train")
    data = open_retrieval_data(config.data.source)
    torch.manual_seed(config.loop.seed)
    model = RetrievalHSTU(RetrievalConfig(item_rows=data.item_rows))
    # keyed by parameter name: a checkpoint holds its state by name, and a resume creates it before loading
    optimizer = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda params: torch.optim.AdamW(
        params, lr=config.optim.dense_lr, betas=ADAMW_BETAS, weight_decay=0.0))
    with run_dirs(config, env) as dirs:
        start_step, start, run_id = 0, LoopPosition(), new_run_id()
        if config.checkpoint.resume:
            start_step, start, run_id = _resume(Path(config.checkpoint.resume), model, optimizer)
        max_history = model.config.max_history
        items, times = data.sequences()
        train: Iterable[RetrievalBatch] = UserBatches([s[:-1] for s in items], [t[:-1] for t in times],
                                                      config.data.batch_size, max_history,
                                                      shuffle_seed=config.loop.seed, epoch=start.epoch)
        if config.data.limit_train_batches:
            train = LimitedBatches(train, config.data.limit_train_batches, config.data.batch_size)
        held_out = UserBatches(items, times, config.data.eval_batch_size, max_history)
        negatives = Negatives(data.catalog, config.model.in_batch_negatives, config.model.random_negatives)
        precision = config.optim.precision
        _log.info("training layout: HSTU retrieval (paper STU layers, D %d, %d layers), %d users, %d items, on cpu "
                  "(%s), sampled softmax over %d random + %d in-batch negatives", model.config.dim,
                  model.config.layers, len(items), data.catalog.numel(), precision, negatives.random,
                  negatives.in_batch)

        checkpoints = ModelCheckpoints(config, model, optimizer, (HSTU_META, model.config.to_dict()), run_id,
                                       dirs.checkpoint_root, JobHooks())
        rates = f"--dense-lr {config.optim.dense_lr:g} (AdamW)"
        with ScalarLog(dirs.log_dir, enabled=True) as log:
            log.log_hparams(config.to_dict(), tuple(f"eval/{name}" for name in METRICS) + ("train/loss",))
            result = run_training(
                model, optimizer, train, held_out, torch.device("cpu"), log,
                loop_options(config, env, start_step, start, learning_rates=rates),
                step_fn=lambda m, opt, batch: train_step(m, opt, batch, negatives, precision),
                checkpoint=checkpoints.save,
                evaluator=lambda m, split, progress=None: evaluate(m, split, data.catalog, precision,
                                                                   config.data.limit_val_batches, progress))
        saved = checkpoints.save(result.steps, result.position)
        _log.info("checkpoint step %d: %s", result.steps, saved)
    return RetrievalSummary(True, result, time.perf_counter() - started, dirs.log_dir, saved, model, data)


def _resume(path: Path, model: RetrievalHSTU, optimizer: KeyedOptimizer) -> tuple[int, LoopPosition, str]:
    """Load the retrieval checkpoint ``path`` (one, or a root: its latest) into ``model``,
    ``optimizer`` and the random state: its (step, position in the data, run id). CheckpointError
    when it is not one of ``--task retrieval`` or its encoder differs from ``model``'s."""
    directory = find_hstu_checkpoint(path)
    meta = open_checkpoint(directory)[1] if directory is not None and not is_legacy(directory) else {}
    if meta.get("config", {}).get("task") != "retrieval":
        raise CheckpointError(f"--resume {path}: not a checkpoint of --task retrieval (train --model hstu --task "
                              "retrieval writes them)")
    if meta[HSTU_META] != model.config.to_dict():
        raise CheckpointError(f"--resume {directory}: its encoder {meta[HSTU_META]} is not this run's "
                              f"{model.config.to_dict()} (another --data?)")
    load_checkpoint(directory, model, optimizer, verify=False)
    restore_rng(directory, 0)
    _log.info("resuming from %s: step %d", directory, meta["step"])
    return int(meta["step"]), LoopPosition(int(meta["epoch"]), int(meta["row"])), run_id_of(directory) or new_run_id()

def not_built(*args: object, **kwargs: object) -> None:
    """``profile`` and ``infer`` of ``--task retrieval``: refused by name."""
    raise ConfigError("--model hstu --task retrieval: profile and infer are not built for it yet (train only)")
