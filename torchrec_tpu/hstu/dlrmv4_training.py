"""What ``train`` and ``profile`` of ``--model dlrmv4`` set up alike: the process group, MLPerf's
DLRMv4 (:mod:`~torchrec_tpu.hstu.dlrmv4`) with its 11 tables sharded over the ranks as TorchRec's
planner says (DistributedModelParallel; the rest in its DDP), MLPerf's optimizers and the day
windows each rank reads its share of.

Optimizers (MLPerf's ``yambda_5b.gin``): the tables' RowWiseAdagrad fused into backward (FBGEMM's
TBE, eps 1e-8: no dense table gradient exists); the rest Adam (betas 0.95/0.999, eps 1e-8, no
weight decay), its gradients clipped to norm 1.0; both ramp from 0 over ``--lr-warmup-steps`` (the
fused rate pushed to the kernels before each backward). ``--precision bf16``: the forward in bfloat16.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torchrec import EmbeddingCollection
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from pipelines.sequences.dlrmv4 import DLRMv4Synthetic
from torchrec_tpu.hstu import dlrmv4_recipe as recipe
from torchrec_tpu.hstu.dlrmv4 import MLPERF_ROWS, DLRMv4, DLRMv4Config, table_configs
from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.distributed import DistEnv, process_group
from torchrec_tpu.train.engines.precision import autocast
from torchrec_tpu.train.engines.torchrec_engine import STORAGE_RESERVED_FRACTION
from torchrec_tpu.train.job import config_agreement, use_rank_threads
from torchrec_tpu.train.learning_rate import LearningRates, LRPolicy
from torchrec_tpu.train.loop import DENSE_BWD, OPTIMIZER
from torchrec_tpu.train.memory_preflight import available_host_bytes, check_table_memory

_log = logging.getLogger(__name__)
FIRST_DAY = 30  # the first training day of the synthetic stream
SPARSE_EPS = 1e-8  # yambda_5b.gin's sparse_optimizer_factory_and_class.eps


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
    sizes by default), in batches of ``global_batch``, at most ``limit`` batches a day (0: all); rank
    ``rank`` of ``world`` reads its equal share of each. A day's last batch is partial: on one rank
    as it is, on several its largest multiple of ``world`` (the rest is dropped)."""

    data: DLRMv4Synthetic
    first: int
    days: int
    anchors: int
    global_batch: int
    limit: int = 0
    rank: int = 0
    world: int = 1

    def day_anchors(self, day: int) -> int:
        """Anchors of day ``first + day``: ``floor((day + 1) A / days) - floor(day A / days)``."""
        return (day + 1) * self.anchors // self.days - day * self.anchors // self.days

    def _sizes(self, day: int) -> list[int]:
        """The day's global batch sizes."""
        whole, rest = divmod(self.day_anchors(day), self.global_batch)
        rest -= rest % self.world
        sizes = [self.global_batch] * whole + ([rest] if rest else [])
        return sizes[:self.limit] if self.limit else sizes

    def __len__(self) -> int:
        return sum(len(self._sizes(day)) for day in range(self.days))

    @property
    def samples(self) -> int:
        """Samples of all ranks."""
        return sum(sum(self._sizes(day)) for day in range(self.days))

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from_row(0)

    def iter_from_row(self, row: int) -> Iterator[Batch]:
        """This rank's batches after its first ``row`` samples (a resume: ``row`` ends a batch)."""
        skipped = 0
        for day in range(self.days):
            for index, size in enumerate(self._sizes(day)):
                if skipped < row:
                    skipped += size // self.world
                    continue
                if skipped != row:
                    raise ValueError(f"DLRMv4 day windows: row {row} of rank {self.rank} is inside a batch; a "
                                     f"checkpoint's rows end one (batches of {self.global_batch // self.world})")
                kjt, labels = self.data.batch(self.first + day, index, size, MLPERF_ROWS, (self.rank, self.world))
                yield Batch(dense_features=torch.zeros(labels.numel(), 0), sparse_features=kjt, labels=labels)


def clipped_step(precision: str, dense: list[nn.Parameter]):
    """The loop's step with the forward at ``precision`` and ``dense``'s gradients clipped to norm
    :data:`~torchrec_tpu.hstu.dlrmv4_recipe.CLIP_NORM` before the update (the tables' fused
    optimizer updates them inside backward)."""

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


def shard(model: DLRMv4Train, env: DistEnv, sparse_lr: float, local_batch: int) -> DistributedModelParallel:
    """``model`` with its tables' RowWiseAdagrad fused into backward at ``sparse_lr``, the tables
    placed over ``env``'s ranks by TorchRec's planner (for ``local_batch`` samples a rank)."""
    tables = list(model.model.embeddings.parameters())
    apply_optimizer_in_backward(RowWiseAdagrad, tables, {"lr": sparse_lr, "eps": SPARSE_EPS})
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=env.world_size, local_world_size=env.local_world_size),
        kernel_config=KernelConfig(compute_device="cpu"))
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=local_batch,
                                       storage_reservation=FixedPercentageStorageReservation(STORAGE_RESERVED_FRACTION))
    plan = planner.collective_plan(model, pg=dist.GroupMember.WORLD)
    return DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan)


def optimizers(model: DistributedModelParallel, dense_lr: float) -> tuple[CombinedOptimizer, list[nn.Parameter]]:
    """MLPerf's optimizers of the sharded ``model``: its fused table optimizer, then Adam (betas
    0.95/0.999, eps 1e-8, no weight decay) at ``dense_lr`` over every other parameter (also
    returned, to clip)."""
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    adam = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adam(ps, lr=dense_lr, betas=recipe.ADAM_BETAS,
                                                                     eps=recipe.ADAM_EPS, weight_decay=0.0))
    return CombinedOptimizer([("sparse", model.fused_optimizer), ("dense", adam)]), list(dense.values())


@dataclass
class DLRMv4Training:
    """The run's sharded model, optimizers, learning rates and data; :meth:`step` is its training step."""

    env: DistEnv
    model_config: DLRMv4Config
    model: DistributedModelParallel
    optimizer: CombinedOptimizer
    dense: list[nn.Parameter]
    rates: LearningRates
    train: DayWindows
    held_out: DayWindows
    precision: str
    engine = "torchrec"  # the tables' (DMP over FBGEMM), whatever --engine says: dlrmv4 does not read it

    def step(self, batch: Batch) -> torch.Tensor:
        """One training step on ``batch`` (its loss, not read back)."""
        return clipped_step(self.precision, self.dense)(self.model, self.optimizer, batch)

    def model_record(self) -> dict:
        """The checkpoint's record of the architecture (:class:`DLRMv4Config`'s fields)."""
        return asdict(self.model_config)

    def describe(self) -> str:
        """The ``training layout:`` line."""
        c = self.model_config
        return (f"training layout: DLRMv4 (11 tables of {c.max_rows:,} rows at most, dim {c.dim}, {c.layers} dlrmv3 "
                f"STU layers, sequence {c.max_seq_len:,}) sharded by TorchRec's planner over {self.env.world_size} "
                f"rank(s) (FBGEMM's TBE on the host), dense part in DDP on cpu ({self.precision})")


@contextlib.contextmanager
def dlrmv4_training(config: TrainConfig, model_config: DLRMv4Config = DLRMv4Config(),
                    world: DLRMv4Synthetic | None = None) -> Iterator[DLRMv4Training]:
    """The run's :class:`DLRMv4Training` inside its process group (the ranks agreeing on
    ``config``, bound with ``--bind-cpus``, ``--num-threads`` set); ``model_config`` and the
    synthetic ``world`` (default: its defaults, histories up to the model's) set the sizes."""
    if config.data.source != "synthetic":
        raise ConfigError(f"--data {config.data.source!r}: --model dlrmv4 reads --data synthetic only "
                          "(MLPerf's Yambda anchors are not on this host)")
    with process_group(config.engine.collective_timeout, False, config.engine.bind_cpus,
                       config_agreement(config)) as env:
        use_rank_threads(config, env, "train")
        batch, eval_batch = config.data.batch_size, config.data.eval_batch_size
        for name, size in (("--batch-size", batch), ("--eval-batch-size", eval_batch)):
            if size % env.world_size:
                raise ConfigError(f"{name} {size}: not a multiple of the {env.world_size} ranks (each reads an "
                                  "equal share of a global batch)")
        tables = table_configs(model_config)
        check_table_memory([t.name for t in tables], [t.num_embeddings for t in tables], model_config.dim,
                           "rowwise_adagrad", env.world_size, env.local_world_size, available_host_bytes(),
                           remedy="the tables are capped at DLRMv4Config.max_rows rows each")
        torch.manual_seed(config.loop.seed)  # every rank builds the same dense weights; DMP draws the tables
        tables_on_meta = EmbeddingCollection(tables=tables, device=torch.device("meta"))  # never a second copy
        model = shard(DLRMv4Train(DLRMv4(model_config, tables_on_meta)), env, config.optim.sparse_lr,
                      batch // env.world_size)
        optim = config.optim
        optimizer, dense = optimizers(model, optim.dense_lr)
        fused = model.fused_optimizer
        rates = LearningRates(LRPolicy(warmup_steps=optim.lr_warmup_steps), optimizer.optimizers[1][1].param_groups,
                              optim.dense_lr, fused.param_groups, optim.sparse_lr, fused.step)
        data = world or DLRMv4Synthetic(max_history=min(model_config.max_history, recipe.HISTORY_LENGTH),
                                        seed=config.loop.seed)
        days = config.loop.epochs
        train = DayWindows(data, FIRST_DAY, days, recipe.TRAIN_SAMPLES * days // recipe.TRAIN_DAYS, batch,
                           config.data.limit_train_batches, env.rank, env.world_size)
        held_out = DayWindows(data, FIRST_DAY + days, 1, recipe.EVAL_SAMPLES, eval_batch,
                              config.data.limit_val_batches, env.rank, env.world_size)
        training = DLRMv4Training(env, model_config, model, optimizer, dense, rates, train, held_out, optim.precision)
        if env.is_primary:
            _log.info(training.describe())
        yield training
