"""``--engine sparsecore``: the stock TorchRec DLRM with its EmbeddingBagCollection replaced by
:class:`ShardedSparseCoreEBC` (fused sparse optimizer in backward), dense part in DDP or FSDP2.

The dense towers run on ``dense_device`` (cpu or tpu, :mod:`torchrec_tpu.train.engines.dense_placement`);
their optimizer is keyed by parameter name, like the torchrec engine's, so checkpoints have the
same shape of state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import closing
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.datasets.utils import Batch
from torchrec.optim.keyed import KeyedOptimizerWrapper

from sparsecore.backends import FBGEMM, OPS, XLA
from sparsecore.limits import PartitionOverflowError
from sparsecore.optimizers import OptimizerSpec
from torchrec_tpu.pipeline import PrefetchedBatches
from torchrec_tpu.rank_agreement import AgreedBatches
from torchrec_tpu.sharding import ShardedSparseCoreEBC
from torchrec_tpu.sharding.uniform_ranks import UniformityError
from torchrec_tpu.sharding.zch import MOD_ROUTING, ZchSpec
from torchrec_tpu.train.config import ConfigError, EngineConfig, OptimConfig, TrainConfig, per_feature_values
from torchrec_tpu.train.distributed import DistEnv, new_group
from torchrec_tpu.train.engines.dense_calibration import StepBuilder
from torchrec_tpu.train.engines.dense_placement import (
    DenseDDP,
    dense_device,
    parallelize_dense,
    place_dense,
    tpu_installed,
)
from torchrec_tpu.train.engines.dense_step import eval_forward, step_function
from torchrec_tpu.train.engines.plan_loading import Placement, resolve_sharding
from torchrec_tpu.train.engines.step_layout import StepLayout, resolve_sparsecore_layout, sparsecore_layout
from torchrec_tpu.train.learning_rate import LearningRates, LRPolicy
from torchrec_tpu.train.loop import StepFn
from torchrec_tpu.train.metrics import EvalForward
from torchrec_tpu.train.model import EBC_PATH, ModelSpec, build_dlrm, ebc_of, table_name
from torchrec_tpu.train.optimizers import dense_optimizer, sparse_optimizer
from tpu_facts import global_batch_of

PIPELINE_DEPTH = 2  # batches whose input dist runs ahead of the training step


def build_sparsecore_model(spec: ModelSpec, env: DistEnv, layout: StepLayout, optim: OptimConfig,
                           options: EngineConfig, global_batch: int, seed: int,
                           table_limits: Mapping[str, tuple[int, int]] | None = None) -> nn.Module:
    """DLRMTrain whose embeddings are sharded over the world on sparsecore (``layout.sparse_backend``) as
    ``options.plan`` says (see :func:`~torchrec_tpu.train.engines.plan_loading.resolve_sharding`),
    trained by ``optim``'s sparse optimizer, and whose dense towers run on ``layout.dense_device``, synced
    by ``layout.dense_parallel``; ``global_batch`` (``--batch-size``), ``seed`` the tables' initialisation.

    The towers are initialised on the host whatever ``dense_device`` is, so a seed gives the
    same model on cpu and tpu. ``table_limits``: (ids, unique ids) partition limits of the tables
    it names (e.g. a checkpoint's FDO stats), over ``--max-ids-per-partition``."""
    model = build_dlrm(spec, dense_device=torch.device("cpu"))
    local_batch = env.local_batch_of(global_batch)
    tables_ebc = ebc_of(model)
    optimizer = sparse_optimizer(optim.sparse_optimizer).sparsecore_spec(optim.sparse_lr)
    limit = options.max_ids_per_partition
    limits = {} if limit is None else {c.name: (limit, limit) for c in tables_ebc.embedding_bag_configs()}
    limits.update(table_limits or {})
    specs = ShardedSparseCoreEBC.specs_of(tables_ebc, local_batch, optimizer, limits or None)  # the tables' specs
    placement = resolve_sharding(options.plan, *specs, env.world_size, global_batch)
    # the EBC's all_to_alls on a group of their own: on the default group the gradient exchange in its
    # backward queued behind DDP's all_reduces of the towers' gradients (32 ms a step at mlperf, 2 ranks)
    group = new_group(env) if env.world_size > 1 and not layout.uniform_ranks else None
    overflow = id_overflow_policy(options.id_overflow, layout.sparse_backend, placement.rank_topology.num_devices)
    ebc = _sparsecore_ebc(tables_ebc, local_batch, placement, optimizer, specs, seed, layout.sparse_backend,
                          layout.uniform_ranks, group, overflow)
    if options.zch is not None:
        ebc.manage_collisions(zch_specs(options, spec.feature_names))
    if options.fdo:
        ebc.record_fdo(env.is_primary)
    model.set_submodule(EBC_PATH, ebc)
    place_dense(model, layout.dense_device)
    ebc_params = [name for name, _ in model.named_parameters() if name.startswith(EBC_PATH)]
    return parallelize_dense(model, env, layout.dense_device, layout.dense_parallel, ebc_params)


def zch_specs(options: EngineConfig, features: tuple[str, ...]) -> dict[str, ZchSpec]:
    """``--zch``'s tables (by table name) and their remap specs (a row-wise table's ids routed to
    the ranks by id mod W: :data:`~torchrec_tpu.sharding.zch.MOD_ROUTING`)."""
    return {table_name(feature): ZchSpec(policy, interval, input_hash_size=MOD_ROUTING)
            for feature, (policy, interval) in options.zch_tables(features).items()}


def id_overflow_policy(id_overflow: str, backend: str, devices_per_rank: int = 1) -> str | None:
    """``--id-overflow``'s policy on ``backend`` with ``devices_per_rank`` devices per rank (auto:
    minibatch where the backend runs the passes, else error); None on fbgemm, whose tables have no
    SparseCore partitions."""
    if backend == FBGEMM:
        return None
    if backend != OPS or devices_per_rank == 1:
        return "minibatch" if id_overflow == "auto" else id_overflow
    if id_overflow == "minibatch":
        raise ConfigError(f"--id-overflow minibatch on --sparse-backend {OPS} minibatches one device's buffers a "
                          f"rank; this plan gives each rank {devices_per_rank} devices (--id-overflow error or drop "
                          f"there, or --sparse-backend {XLA})")
    return "error" if id_overflow == "auto" else id_overflow


def _sparsecore_ebc(tables_ebc: EmbeddingBagCollection, local_batch: int, placement: Placement,
                    optimizer: OptimizerSpec, specs: tuple, seed: int, backend: str,
                    uniform: bool, group: dist.ProcessGroup | None, overflow: str | None) -> ShardedSparseCoreEBC:
    """The sharded EBC over ``group`` (None: the default group), its ranks' stacks padded to one
    shape where ``uniform`` (the layout's lookup inside the step program, several ranks); a plan
    they cannot be padded for fails here. ``overflow``: the backend's id overflow policy (None: it
    has none)."""
    extra = {} if overflow is None else {"overflow": overflow}
    try:
        return ShardedSparseCoreEBC.from_torchrec(
            tables_ebc, local_batch, placement.sharding, optimizer, specs=specs, topology=placement.rank_topology,
            seed=seed, average_over_ranks=True, backend=backend, uniform_ranks=uniform, group=group, **extra)
    except UniformityError as error:
        raise ConfigError(f"the training layout runs the embedding lookup inside the step program, which needs "
                          f"every rank's stacks padded to one shape, but this plan's cannot be ({error}); "
                          f"--sparse-backend xla runs the lookup outside the program, or change --plan") from None


def sharding_plan_text(ebc: ShardedSparseCoreEBC, plan: str | None) -> str:
    """One line per table of ``ebc``: rows x dim, sharding type, and each shard's rank, rows and
    columns; ``plan``: the ``--plan`` it came from."""
    source = {None: "whole tables balanced over the ranks", "auto": "--plan auto"}.get(plan, f"--plan {plan}")
    lines = [f"sharding plan ({len(ebc.tables)} tables over {ebc.world_size} rank(s), {source}):"]
    width = max(len(name) for name in ebc.tables)
    for name, table in ebc.tables.items():
        shards = ebc.shards[name]
        parts = ", ".join(f"rank {s.rank} ({s.rows:,} rows, cols {s.col_offset}-{s.col_offset + s.cols - 1})"
                          for s in shards)
        lines.append(f"  {name:<{width}}  {table.vocab_size:>11,} x {table.dim:<4} {shards[0].kind:<13} {parts}")
    return "\n".join(lines)


def unwrap_dense(model: nn.Module) -> nn.Module:
    """The model inside its dense DDP wrapper (``model`` itself when not wrapped)."""
    return model.module if isinstance(model, DenseDDP) else model


def pipelined(batches: Iterable[Batch], model: nn.Module, env: DistEnv, device: torch.device,
              depth: int = PIPELINE_DEPTH) -> PrefetchedBatches:
    """``batches`` with their input dist run ``depth`` batches ahead on a background thread (over
    a process group of its own when there are several ranks, where the ranks agree on each batch:
    :mod:`~torchrec_tpu.rank_agreement`; a collective: call on every rank)."""
    ebc = ebc_of(unwrap_dense(model))
    group = new_group(env) if env.world_size > 1 else None
    return PrefetchedBatches(batches, ebc, device, depth, group,
                             partial(overflow_with_flags, global_batch_of(ebc.padded_local_batch, env.world_size)))


def overflow_with_flags(global_batch: int, error: Exception) -> Exception:
    """A SparseCore partition over its id limit, with the fix as flags of ``train`` / ``profile``
    (``global_batch``: ``--batch-size``, padded for the SparseCores): the ids a partition gets grow with the batch each
    SparseCore sees. Other errors as they are."""
    if not isinstance(error, PartitionOverflowError):
        return error
    return PartitionOverflowError(error.overflow, f"raise --max-ids-per-partition, use --id-overflow minibatch, "
                                                  f"lower --batch-size (now {global_batch}) "
                                                  "or train on more ranks (torchrun --nproc-per-node), which spreads "
                                                  "each batch over more SparseCores")


def build_dense_optimizer(model: nn.Module, optim: OptimConfig, towers_on: torch.device) -> KeyedOptimizerWrapper:
    """``optim``'s dense optimizer over every parameter outside the sparsecore EBC, keyed by its
    name in the unwrapped model (the same at every world size); the towers run on ``towers_on``
    (the layout's dense device)."""
    dense = dense_optimizer(optim.dense_optimizer)
    params = {name: p for name, p in unwrap_dense(model).named_parameters() if not name.startswith(EBC_PATH)}
    # on the host, fused: one kernel updates every parameter (Adagrad over mlperf's 16M dense
    # parameters on one core: 6.6 ms, against 20.8 for torch's default per-parameter loop, within
    # float32 rounding of it); on tpu, foreach: one multi-tensor op instead of one per parameter
    extra = {"fused": True} if towers_on.type == "cpu" else {"foreach": True}
    return KeyedOptimizerWrapper(params, lambda ps: dense.build(ps, optim.dense_lr, **extra))


def timed_step_builder(optim: OptimConfig, sparse_backend: str) -> StepBuilder:
    """How ``--dense-device auto`` builds the step it times (:mod:`.dense_calibration`): this
    engine's whole training step at one rank, with ``optim``'s optimizers and precision and
    ``--sparse-backend sparse_backend``, the towers on the placement being timed, its batches
    pipelined as the job's (:func:`pipelined`)."""
    options = EngineConfig(sparse_backend=sparse_backend)

    def build(towers_on: str, spec: ModelSpec, local_batch: int) -> Callable[[Iterable[Batch]], Iterator[torch.Tensor]]:
        layout = sparsecore_layout(options, optim, 1, local_batch, dense_device(towers_on))
        env = DistEnv(0, 1, 1)
        steps_log = logging.getLogger(step_function.__module__)
        level = steps_log.level
        steps_log.setLevel(logging.WARNING)  # the timed steps' "training step:" lines are not the job's
        try:
            model = build_sparsecore_model(spec, env, layout, optim, options,
                                           global_batch_of(local_batch, 1), seed=0)
            optimizer = build_dense_optimizer(model, optim, layout.dense_device)
            step = step_function(model, optimizer, layout)
        finally:
            steps_log.setLevel(level)

        def train(batches: Iterable[Batch]) -> Iterator[torch.Tensor]:
            with closing(iter(pipelined(batches, model, env, torch.device("cpu")))) as prefetched:
                for batch in prefetched:
                    yield step(model, optimizer, batch)

        return train

    return build


@dataclass(frozen=True)
class SparseCoreEngine:
    """The :class:`~torchrec_tpu.train.engines.Engine` of our sparsecore EBC (``options.sparse_backend``), sharded
    as ``options.plan`` says, dense towers on ``options.dense_device`` synced by
    ``options.dense_parallel``; ``optim``'s optimizers, ``global_batch`` (``--batch-size``), ``seed``
    the tables' initialisation, ``multi_hot_sizes`` the batches' ids per feature
    (``--multi-hot-sizes``, which ``--dense-device auto`` times the step with; None: one)."""

    optim: OptimConfig
    options: EngineConfig
    global_batch: int
    seed: int
    multi_hot_sizes: str | None = None
    name = "sparsecore"

    @classmethod
    def from_config(cls, config: TrainConfig) -> SparseCoreEngine:
        return cls(config.optim, config.engine, config.data.batch_size, config.loop.seed,
                   config.data.multi_hot_sizes)

    @property
    def needs_device_tensors(self) -> bool:
        # (auto picks tpu at several ranks only on an accelerator, asked before JAX starts)
        return self.options.dense_device == "tpu" or (self.options.dense_device == "auto" and tpu_installed())

    def step_layout(self, spec: ModelSpec, env: DistEnv) -> StepLayout:
        ids = per_feature_values("multi_hot_sizes", self.multi_hot_sizes, len(spec.feature_names))
        return resolve_sparsecore_layout(self.options, self.optim, spec, env.world_size, self.global_batch, ids,
                                         timed_step_builder(self.optim, self.options.sparse_backend))

    def build_model(self, spec: ModelSpec, env: DistEnv, device: torch.device, layout: StepLayout) -> nn.Module:
        """(The batches stay on the host, ``device``; the towers go to ``layout``'s dense device.)"""
        return build_sparsecore_model(spec, env, layout, self.optim, self.options, self.global_batch, self.seed)

    def build_optimizer(self, model: nn.Module, layout: StepLayout) -> KeyedOptimizerWrapper:
        return build_dense_optimizer(model, self.optim, layout.dense_device)

    def wrap_batches(self, batches: Iterable[Batch], model: nn.Module, env: DistEnv, device: torch.device,
                     background: bool = True) -> Iterable[Batch]:
        """:func:`pipelined` (input dist on a prefetch thread, ranks agreeing there); without
        ``background`` the input dist runs inside the step and the ranks agree on the default group."""
        if background:
            return pipelined(batches, model, env, device)
        return AgreedBatches(batches, None, env.rank, env.world_size) if env.world_size > 1 else batches

    def step_function(self, model: nn.Module, optimizer: torch.optim.Optimizer, layout: StepLayout) -> StepFn:
        return step_function(model, optimizer, layout)

    def eval_forward(self, model: nn.Module, layout: StepLayout) -> EvalForward:
        return eval_forward(model, layout)

    def sharding_plan(self, model: nn.Module) -> str:
        return sharding_plan_text(ebc_of(unwrap_dense(model)), self.options.plan)

    def learning_rates(self, policy: LRPolicy, model: nn.Module, optimizer: torch.optim.Optimizer) -> LearningRates:
        """Over the dense groups; the fused embedding rate is fixed (``policy`` must be constant)."""
        return LearningRates(policy, list(optimizer.param_groups), self.optim.dense_lr, None, self.optim.sparse_lr)
