"""``torchrec-tpu train --model hstu``: HSTU trained on a sequence dataset's window T and
evaluated on window T + 1 (MLPerf DLRMv4's protocol), with the train command's common options.

Tables: the sharded SparseCore EmbeddingCollection with fused row-wise Adagrad (``--engine
sparsecore``, the default) or stock TorchRec's with TorchRec's RowWiseAdagrad (``--engine
torchrec``, the reference); the STU stack and heads: Adam at ``--dense-lr`` on ``--dense-device``
(``auto``: tpu), DDP over the ranks. Data (``--data``): ``synthetic`` (generated once into the
cache), ``sample`` (the bundled real MovieLens rows) or a directory written by ``torchrec-tpu data
sequences``. The options it reads and its defaults: :mod:`torchrec_tpu.train.model_kinds`; its loop
(schedules, resume, progress, events) is DLRM's, :func:`~torchrec_tpu.train.loop.run_training`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torch.nn import functional
from torchmetrics.classification import BinaryAUROC
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper

from pipelines.sequences import read_meta, read_movielens, synthetic_events, window_path, write_sequences
from pipelines.sequences.layout import SequenceMeta
from pipelines.sequences.reader import SequenceBatch, SequenceReader
from pipelines.synthetic import cache_root
from sparsecore.backends import FBGEMM, XLA
from torchrec_tpu.hstu.attention import describe
from torchrec_tpu.hstu.config import HSTUConfig, preset
from torchrec_tpu.hstu.model import HSTU, default_dense_device, table_configs
from torchrec_tpu.hstu.sharded import sharded_embeddings
from torchrec_tpu.train.checkpoint.dirs import new_run_id, run_id_of
from torchrec_tpu.train.checkpoint.hstu_files import (
    HSTU_META,
    find_hstu_checkpoint,
    hstu_meta,
    is_legacy,
    legacy_state,
)
from torchrec_tpu.train.checkpoint.manifest import CheckpointError
from torchrec_tpu.train.checkpoint.store import load_checkpoint, open_checkpoint, restore_rng
from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.distributed import DistEnv, process_group
from torchrec_tpu.train.engines.dense_placement import dense_device as placed_on
from torchrec_tpu.train.engines.precision import autocast
from torchrec_tpu.train.engines.step_layout import CALIBRATION_BATCH_CAP, StepLayout
from torchrec_tpu.train.job import (
    HPARAM_METRICS,
    JobHooks,
    ModelCheckpoints,
    config_agreement,
    loop_options,
    on_primary,
    run_dirs,
    run_events,
    use_rank_threads,
)
from torchrec_tpu.train.loop import COLLECTIVES, DENSE_BWD, OPTIMIZER, LoopPosition, TrainResult, run_training
from torchrec_tpu.train.memory_preflight import available_host_bytes, check_table_memory
from torchrec_tpu.train.metrics import normalized_entropy
from torchrec_tpu.train.model_kinds import MODEL_KINDS
from torchrec_tpu.train.scalars import ScalarLog
from torchrec_tpu.train.streams import LimitedBatches

_log = logging.getLogger(__name__)
SYNTHETIC = {"users": 3000, "items": 1000, "events_per_user": 40, "seed": 1}
WINDOWS, CANDIDATES, MAX_HISTORY = 4, 4, 60

HSTU_TABLES_REMEDY = ("the item table has the dataset's item_rows (meta.json: its largest item id + 1); rewrite the "
                      "dataset with `torchrec-tpu data sequences --max-item-rows` or remap its item ids")


def dataset_dir(config: TrainConfig, env: DistEnv) -> Path:
    """The sequence dataset ``--data`` names, generated into the cache on first use (rank 0)."""
    source = config.data.source
    if source not in ("synthetic", "sample"):
        return Path(source)
    name = "hstu-synthetic-v2-" + "-".join(f"{v}" for v in SYNTHETIC.values()) if source == "synthetic" \
        else "hstu-movielens-sample"
    path = cache_root(config.data.cache_dir) / name
    if env.is_primary and not (path / "meta.json").exists():
        if source == "synthetic":
            events = synthetic_events(**SYNTHETIC)
        else:
            from pipelines.sample_data import movielens_sample_csv
            events = read_movielens(movielens_sample_csv())
        staging = path.with_name(path.name + f".partial-{time.time_ns()}")
        write_sequences(events, staging, windows=WINDOWS if source == "synthetic" else 2,
                        max_history=MAX_HISTORY, candidates=CANDIDATES)
        staging.rename(path)
    if dist.is_initialized():
        dist.barrier()
    return path


@dataclass(frozen=True)
class HSTUSummary:
    """What a run reports: the loop's result (its evaluation: AUC and NE per task), time, where it went."""

    primary: bool
    result: TrainResult
    seconds: float
    log_dir: Path
    checkpoint: Path

    def format(self) -> str:
        r = self.result
        steady = r.steady_samples_per_sec
        rate = f"{steady:,.0f} users/s steady (after the first step)" if steady else "one step, no steady figure"
        return "\n".join([f"HSTU: {r.steps} steps in {self.seconds:.0f} s",
                          f"  AUC (window T+1, {r.eval.samples:,} candidates): {r.eval.describe()}",
                          f"  throughput      {rate}",
                          f"  TensorBoard     {self.log_dir}",
                          f"  checkpoint      {self.checkpoint}"])


def dense_device(config: TrainConfig) -> torch.device:
    """``--dense-device`` as the process group is joined; ``auto``:
    :func:`~torchrec_tpu.hstu.model.default_dense_device` (on XLA:CPU at one rank the job then times
    both placements: :func:`stack_device`)."""
    choice = config.engine.dense_device
    return default_dense_device() if choice == "auto" else placed_on(choice)


def stack_device(config: TrainConfig, env: DistEnv, meta: SequenceMeta, joined: torch.device) -> torch.device:
    """Where the STU stack and heads run: ``joined`` (:func:`dense_device`), except ``--dense-device
    auto`` on XLA:CPU at one rank, where the faster of the job's whole steps with them in CPU eager
    torch and as one compiled tpu program wins (:mod:`~torchrec_tpu.hstu.placement`, timed once)."""
    if config.engine.dense_device != "auto" or joined.type == "tpu" or env.world_size > 1:
        return joined
    from torchrec_tpu.hstu.placement import measured_stack_device

    def build_step(name: str, capped: SequenceMeta) -> Callable[[SequenceBatch], torch.Tensor]:
        layout = step_layout(config, env, placed_on(name))
        model, _ = build(config, capped, env, layout)
        return step_function(model, *optimizers(config, model), layout)

    local_batch = min(env.local_batch_of(config.data.batch_size), CALIBRATION_BATCH_CAP)
    return placed_on(measured_stack_device(config, env, meta, history_of(model_config(config, meta), meta),
                                           local_batch, build_step))


def step_layout(config: TrainConfig, env: DistEnv, device: torch.device) -> StepLayout:
    """HSTU's step as a :class:`~torchrec_tpu.train.engines.step_layout.StepLayout`: the STU stack
    and heads on ``device``, one compiled program per step on tpu at one rank, else eager
    (gradients averaged over the ranks as DDP does); the tables' lookup and update outside it, on
    their backend (``fbgemm``: the torchrec engine's, as DLRM's layout names it); the precision.
    (Several ranks: each rank's jagged batch pads to its own shape, and one SPMD program needs one.)"""
    backend = FBGEMM if config.engine.kind == "torchrec" else sparse_backend(config)
    one_program = device.type == "tpu" and env.world_size == 1
    return StepLayout(dense_device=device, dense_parallel="ddp", sparse_backend=backend, one_program=one_program,
                      lookup_in_step=False, uniform_ranks=False, precision=config.optim.precision,
                      world_size=env.world_size,
                      lookup_outside="the sequence tables look up beside it" if one_program else "")


def model_config(config: TrainConfig, meta: SequenceMeta) -> HSTUConfig:
    """The :class:`HSTUConfig` of ``--model``'s preset (its STU layer: ``--stu``) for the dataset ``meta``."""
    layer = {} if config.model.stu == "auto" else {"stu": config.model.stu}
    return preset(config.model.kind, meta.item_rows, meta.action_rows, tasks=tuple(meta.tasks), **layer)


def history_of(hstu_config: HSTUConfig, meta: SequenceMeta) -> int:
    """The history events read per user: the dataset's, at most what ``max_seq_len`` leaves the candidates."""
    return min(meta.max_history, hstu_config.max_seq_len - meta.candidates)


def build(config: TrainConfig, meta: SequenceMeta, env: DistEnv, layout: StepLayout) -> tuple[HSTU, HSTUConfig]:
    """The model of ``--model``'s preset (its STU layer: ``--stu``) for the dataset ``meta``, its
    tables on ``--engine``, laid out as ``layout`` says."""
    hstu_config = model_config(config, meta)
    tables = table_configs(hstu_config)
    check_table_memory([t.name for t in tables], [t.num_embeddings for t in tables], hstu_config.dim,
                       "rowwise_adagrad", env.world_size, env.local_world_size, available_host_bytes(),
                       remedy=HSTU_TABLES_REMEDY)
    torch.manual_seed(config.loop.seed)
    if config.engine.kind == "torchrec":
        embeddings = None
    else:
        embeddings = sharded_embeddings(
            hstu_config, optimizer=_sparse_spec(config), local_batch=env.local_batch_of(config.data.batch_size),
            backend=layout.sparse_backend, seed=config.loop.seed, average_over_ranks=True,
            ec=_seeded_ec(hstu_config, config.loop.seed))
    return HSTU(hstu_config, embeddings, dense_device=layout.dense_device), hstu_config


def sparse_backend(config: TrainConfig) -> str:
    """``--sparse-backend`` (``auto``: XLA) of the sharded tables."""
    return XLA if config.engine.sparse_backend == "auto" else config.engine.sparse_backend


def _seeded_ec(hstu_config: HSTUConfig, seed: int):
    from torchrec import EmbeddingCollection
    torch.manual_seed(seed)
    return EmbeddingCollection(tables=table_configs(hstu_config), device=torch.device("cpu"))


def _sparse_spec(config: TrainConfig):
    from sparsecore.optimizers import RowWiseAdagrad
    return RowWiseAdagrad(config.optim.sparse_lr)


def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The training loss: binary cross-entropy of every task's logit, averaged."""
    return functional.binary_cross_entropy_with_logits(logits.float(), labels.to(logits.device))


@dataclass(frozen=True)
class HSTUEval:
    """An evaluation over every rank's candidates: AUC and NE per task, the mean loss over tasks.
    ``auc`` and ``ne`` (what ``--target-auc``, the best evaluation and MLPerf's log read) are the
    means over tasks."""

    task_auc: dict[str, float]
    task_ne: dict[str, float]
    loss: float
    samples: int  # candidates scored
    accuracy: float = float("nan")

    @property
    def auc(self) -> float:
        return sum(self.task_auc.values()) / len(self.task_auc)

    @property
    def ne(self) -> float:
        return sum(self.task_ne.values()) / len(self.task_ne)

    def describe(self) -> str:
        """``click 0.7012, like 0.6543; NE click 0.9321, like 0.9710; loss 0.5012`` (the AUCs first)."""
        aucs, nes = (", ".join(f"{task} {v:.4f}" for task, v in d.items()) for d in (self.task_auc, self.task_ne))
        return f"{aucs}; NE {nes}; loss {self.loss:.4f}"

    def scalars(self, split: str = "eval") -> dict[str, float]:
        """The TensorBoard scalars: ``<split>/loss``, ``<split>/auc`` and ``<split>/ne`` (the means),
        ``<split>/auc/<task>``, ``<split>/ne/<task>``."""
        return {f"{split}/loss": self.loss, f"{split}/auc": self.auc, f"{split}/ne": self.ne,
                **{f"{split}/auc/{task}": a for task, a in self.task_auc.items()},
                **{f"{split}/ne/{task}": n for task, n in self.task_ne.items()}}


@torch.no_grad()
def evaluate(model: nn.Module, reader: Iterable[SequenceBatch], device: torch.device, precision: str,
             limit: int = 0, progress: Callable[[int, int], None] | None = None) -> HSTUEval:
    """AUC and NE per task (over every rank's candidates), mean loss and candidate count of
    ``reader``'s first ``limit`` batches (0: all); ``progress(candidates, batches)`` hears the
    count scored after each batch."""
    model.eval()
    tasks = reader.tasks  # type: ignore[attr-defined]
    aucs = [BinaryAUROC() for _ in tasks]
    total = torch.zeros(2 * len(tasks) + 1, dtype=torch.float64)  # loss sums per task, label sums per task, rows
    for i, batch in enumerate(reader):
        if limit and i >= limit:
            break
        with autocast(device.type, precision):
            logits = model(batch.features).float().cpu()
        for t, auc in enumerate(aucs):
            auc.update(torch.sigmoid(logits[:, t]), batch.labels[:, t].int())
        losses = functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none").sum(0)
        total += torch.cat([losses.double(), batch.labels.double().sum(0), torch.tensor([batch.labels.shape[0]],
                                                                                          dtype=torch.float64)])
        if progress is not None:
            progress(int(total[-1]), i + 1)
    if dist.is_initialized():
        dist.all_reduce(total)
    model.train()
    rows, n = int(total[-1]), len(tasks)
    if rows == 0:
        raise ValueError("evaluation window is empty: no candidates to compute AUC on")
    losses, rates = (total[:n] / rows).tolist(), (total[n:-1] / rows).tolist()
    return HSTUEval({task: float(auc.compute()) for task, auc in zip(tasks, aucs)},
                    {task: normalized_entropy(loss, rate) for task, loss, rate in zip(tasks, losses, rates)},
                    sum(losses) / n, rows)


TABLES_PREFIX = "embeddings."


@dataclass
class HSTUTraining:
    """What ``train`` and ``profile`` set up alike for ``--model hstu``: the model of the
    preset on its tables and dense device, the readers of windows T and T + 1, the optimizers;
    :meth:`step` is the training step both run."""

    env: DistEnv
    hstu_config: HSTUConfig
    model: HSTU
    layout: StepLayout
    train: SequenceReader
    held_out: SequenceReader
    adam: KeyedOptimizer
    sparse_opt: KeyedOptimizer | None
    step: Callable[[SequenceBatch], torch.Tensor]  # one training step on a batch: its loss (not read back)

    @property
    def device(self) -> torch.device:
        """Where the STU stack and heads run."""
        return self.layout.dense_device

    @property
    def optimizer(self) -> KeyedOptimizer:
        """The optimizers whose state a checkpoint holds, keyed by parameter name (the sharded tables'
        fused optimizer keeps its slots in the model's state)."""
        if self.sparse_opt is None:
            return self.adam
        return CombinedOptimizer([("dense", self.adam), ("sparse", self.sparse_opt)])

    def describe(self, config: TrainConfig) -> str:
        """The ``training layout:`` line: where the tables and the STU stack run, and the step."""
        tables = "stock TorchRec EmbeddingCollection (CPU)" if self.sparse_opt is not None else (
            f"sharded SparseCore EmbeddingCollection (row-wise, {self.layout.sparse_backend} backend)")
        step = (f"the stack, heads and dense optimizer as one compiled program per step, "
                f"{self.layout.lookup_outside}" if self.layout.one_program else "an eager step")
        return (f"training layout: HSTU ({config.model.kind}, {self.hstu_config.stu} STU layers) tables on the "
                f"{tables}, STU stack and heads on {self.device.type} ({self.layout.precision}), attention by the "
                f"{describe(self.hstu_config.kernel, self.device)}, {step}, {self.env.world_size} rank(s)")


@contextlib.contextmanager
def hstu_training(config: TrainConfig) -> Iterator[HSTUTraining]:
    """The run's :class:`HSTUTraining` inside its process group (the ranks agreeing on ``config``,
    bound to their CPUs with ``--bind-cpus``, ``--num-threads`` set); logs the layout line, as DLRM's
    jobs do."""
    joined = dense_device(config)
    with process_group(config.engine.collective_timeout, joined.type == "tpu", config.engine.bind_cpus,
                       config_agreement(config)) as env:
        use_rank_threads(config, env, "train")
        directory = dataset_dir(config, env)
        meta = read_meta(directory)
        if meta.windows < 2:
            raise ConfigError(f"--data {directory}: {meta.windows} time window; training on T and evaluating on "
                              "T + 1 needs at least 2 (`torchrec-tpu data sequences --windows`)")
        layout = step_layout(config, env, stack_device(config, env, meta, joined))
        model, hstu_config = build(config, meta, env, layout)
        history = history_of(hstu_config, meta)
        train = SequenceReader(window_path(directory, meta.windows - 2), env.local_batch_of(config.data.batch_size),
                               max_history=history, item_rows=hstu_config.item_rows,
                               action_rows=hstu_config.action_rows, max_seq_len=hstu_config.max_seq_len,
                               tasks=hstu_config.tasks, shuffle_seed=config.loop.seed, rank=env.rank,
                               world_size=env.world_size)
        held_out = SequenceReader(window_path(directory, meta.windows - 1),
                                  env.local_batch_of(config.data.eval_batch_size),
                                  max_history=history, item_rows=hstu_config.item_rows,
                                  action_rows=hstu_config.action_rows, max_seq_len=hstu_config.max_seq_len,
                                  tasks=hstu_config.tasks, rank=env.rank, world_size=env.world_size)
        if env.world_size > 1:
            for p in _dense_parameters(model):  # every rank starts from rank 0's dense weights
                dist.broadcast(p.data, 0)
        adam, sparse_opt = optimizers(config, model)
        training = HSTUTraining(env, hstu_config, model, layout, train, held_out, adam, sparse_opt,
                                step_function(model, adam, sparse_opt, layout))
        if env.is_primary:
            _log.info(training.describe(config))
        yield training


def _dense_parameters(model: HSTU) -> list[nn.Parameter]:
    """The STU stack's and heads' parameters (not the tables')."""
    return [p for name, p in model.named_parameters() if not name.startswith(TABLES_PREFIX)]


def optimizers(config: TrainConfig, model: HSTU) -> tuple[KeyedOptimizer, KeyedOptimizer | None]:
    """Adam at ``--dense-lr`` on the stack and heads; with ``--engine torchrec`` TorchRec's
    RowWiseAdagrad at ``--sparse-lr`` on the tables (the sharded EC's is fused into its backward)."""
    sparse_opt = None
    if config.engine.kind == "torchrec":
        from torchrec.optim import RowWiseAdagrad
        sparse_opt = KeyedOptimizerWrapper(
            {name: p for name, p in model.named_parameters() if name.startswith(TABLES_PREFIX)},
            lambda ps: RowWiseAdagrad(ps, lr=config.optim.sparse_lr))
    adam = KeyedOptimizerWrapper({name: p for name, p in model.named_parameters()
                                  if not name.startswith(TABLES_PREFIX)},
                                 lambda ps: torch.optim.Adam(ps, lr=config.optim.dense_lr))
    return adam, sparse_opt


def step_function(model: HSTU, adam: KeyedOptimizer, sparse_opt: KeyedOptimizer | None,
                  layout: StepLayout) -> Callable[[SequenceBatch], torch.Tensor]:
    """The training step ``layout`` says: the compiled program
    (:class:`~torchrec_tpu.hstu.compiled_step.CompiledHSTUStep`) or the eager step."""
    if layout.one_program:
        from torchrec_tpu.hstu.compiled_step import CompiledHSTUStep
        return CompiledHSTUStep(model, adam, sparse_opt, layout)
    return functools.partial(_train_step, model, adam=adam, sparse_opt=sparse_opt, device=layout.dense_device,
                             precision=layout.precision, dense=_dense_parameters(model),
                             world_size=layout.world_size)


class WindowBatches:
    """Window T's batches as the training loop streams them (a
    :class:`~pipelines.streams.BatchStream` of :class:`SequenceBatch`): each pass is the next epoch,
    reshuffled, the first being ``epoch``; ``iter_from_row`` resumes a pass at a row of this rank's."""

    def __init__(self, reader: SequenceReader, epoch: int) -> None:
        self.reader, self.epoch = reader, epoch

    def __len__(self) -> int:
        return len(self.reader)

    def __iter__(self) -> Iterator[SequenceBatch]:
        return self.iter_from_row(0)

    def iter_from_row(self, row: int) -> Iterator[SequenceBatch]:
        batches = self.reader.batches(self.epoch, row)
        self.epoch += 1
        return batches


def run_hstu(config: TrainConfig, hooks: JobHooks = JobHooks()) -> HSTUSummary:
    """Train and evaluate HSTU as ``config`` says (module docstring) through the training loop
    (:func:`~torchrec_tpu.train.loop.run_training`: its schedules, progress, divergence guard and
    events); ``hooks.checkpointed`` hears every checkpoint on every rank (Ray Train reports it)."""
    started = time.perf_counter()
    with hstu_training(config) as t, run_dirs(config, t.env) as dirs:
        env = t.env
        start_step, start, run_id = 0, LoopPosition(), on_primary(new_run_id, env)
        if config.checkpoint.resume:
            start_step, start, run_id = _resume(Path(config.checkpoint.resume), t)
        train: Iterable[SequenceBatch] = WindowBatches(t.train, start.epoch)
        if config.data.limit_train_batches:
            train = LimitedBatches(train, config.data.limit_train_batches, t.train.batch_size)
        checkpoint = ModelCheckpoints(config, t.model, t.optimizer, (HSTU_META, t.hstu_config.to_dict()), run_id,
                                      dirs.checkpoint_root, hooks)
        sparse, dense = MODEL_KINDS[config.model.kind].optimizers  # type: ignore[misc]
        rates = f"--sparse-lr {config.optim.sparse_lr:g} ({sparse}), --dense-lr {config.optim.dense_lr:g} ({dense})"
        with ScalarLog(dirs.log_dir, env.is_primary) as log, \
                run_events(config, env, _epoch_samples(config, t.train, env)) as events:
            log.log_hparams(config.to_dict(), HPARAM_METRICS)
            result = run_training(
                t.model, t.optimizer, train, t.held_out, torch.device("cpu"), log,
                loop_options(config, env, start_step, start, learning_rates=rates),
                step_fn=lambda model, optimizer, batch: t.step(batch), checkpoint=checkpoint.save,
                evaluator=functools.partial(evaluate, device=t.device, precision=t.layout.precision,
                                            limit=config.data.limit_val_batches), events=events)
        saved = checkpoint.save(result.steps, result.position)
        if env.is_primary:
            _log.info("checkpoint step %d: %s", result.steps, saved)
        return HSTUSummary(env.is_primary, result, time.perf_counter() - started, dirs.log_dir, saved)


def _epoch_samples(config: TrainConfig, reader: SequenceReader, env: DistEnv) -> int:
    """Users trained in an epoch, all ranks (at most ``--limit-train-batches`` batches a rank)."""
    rows = reader.rows.size
    if config.data.limit_train_batches:
        rows = min(rows, config.data.limit_train_batches * reader.batch_size)
    return rows * env.world_size


def _resume(path: Path, t: HSTUTraining) -> tuple[int, LoopPosition, str]:
    """Load the HSTU checkpoint ``path`` (one, or a root: its latest) into ``t``'s model and
    optimizers and this rank's random state: its (step, position in the data, run id).
    CheckpointError when it is not an HSTU checkpoint or another world size wrote it (each rank
    resumes its own rows of the window)."""
    directory = find_hstu_checkpoint(path)
    if directory is None:
        raise CheckpointError(f"--resume {path}: not an HSTU checkpoint (no meta.json with a {HSTU_META!r} record)")
    legacy = is_legacy(directory)
    meta = hstu_meta(directory) if legacy else open_checkpoint(directory)[1]
    saved = HSTUConfig.from_dict(meta[HSTU_META]).stu
    if saved != t.hstu_config.stu:
        raise CheckpointError(f"--resume {directory}: its STU layers are {saved!r}, this run's "
                              f"{t.hstu_config.stu!r}; resume it with --stu {saved}")
    if meta.get("world_size", 1) != t.env.world_size:
        raise CheckpointError(f"cannot resume {directory} exactly: it was written by {meta.get('world_size')} "
                              f"rank(s), this run has {t.env.world_size} (each rank resumes its own rows)")
    if legacy:
        state, adam = legacy_state(directory, t.env.rank)
        t.model.load_state_dict(state)
        t.adam._optimizer.load_state_dict(adam)
    else:
        load_checkpoint(directory, t.model, t.optimizer, verify=False)
        restore_rng(directory, t.env.rank)
    if t.env.is_primary:
        _log.info("resuming from %s: step %d", directory, meta["step"])
    run_id = None if legacy else run_id_of(directory)
    position = LoopPosition(int(meta["epoch"]), trained_rows(meta, t.env, t.train.batch_size))
    return int(meta["step"]), position, run_id or new_run_id()


def trained_rows(meta: dict, env: DistEnv, local_batch: int) -> int:
    """The rows of its epoch each rank had trained when checkpoint ``meta`` was written; checkpoints
    before ``row`` kept whole batches (``batch``) of their ``--batch-size`` (where they do not say
    which: of this run's ``local_batch``, as they were resumed before)."""
    if "row" in meta:
        return int(meta["row"])
    saved = meta.get("config", {}).get("batch_size")
    return int(meta["batch"]) * (env.local_batch_of(int(saved)) if saved else local_batch)


def _train_step(model: HSTU, batch: SequenceBatch, *, adam: KeyedOptimizer, sparse_opt, device: torch.device,
                precision: str, dense: list[nn.Parameter], world_size: int) -> torch.Tensor:
    with autocast(device.type, precision):
        logits = model(batch.features)
    step_loss = loss(logits, batch.labels)
    adam.zero_grad()
    if sparse_opt is not None:
        sparse_opt.zero_grad()
    with record_function(DENSE_BWD):  # the fused table update runs inside backward
        step_loss.backward()
    if world_size > 1:
        with record_function(COLLECTIVES):
            for p in dense:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
    with record_function(OPTIMIZER):
        adam.step()
        if sparse_opt is not None:
            sparse_opt.step()
    return step_loss.detach()


