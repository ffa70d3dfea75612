"""``--engine torchrec``: shard a model with TorchRec's DistributedModelParallel and set up its optimizers.

Embedding tables get a *fused* optimizer: ``apply_optimizer_in_backward`` marks them before
sharding, and FBGEMM's TBE then updates each touched row inside backward (no dense gradient for
the tables ever exists). The MLPs get an ordinary torch optimizer. Both are combined into one
``CombinedOptimizer`` whose ``state_dict`` covers everything, for checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_tpu.rank_agreement import AgreedBatches
from torchrec_tpu.train.config import OptimConfig, TrainConfig
from torchrec_tpu.train.distributed import DistEnv
from torchrec_tpu.train.engines.precision import eager_eval_forward, eager_train_step
from torchrec_tpu.train.engines.step_layout import StepLayout, torchrec_layout
from torchrec_tpu.train.learning_rate import LearningRates, LRPolicy
from torchrec_tpu.train.loop import StepFn
from torchrec_tpu.train.metrics import EvalForward
from torchrec_tpu.train.model import ModelSpec, build_dlrm
from torchrec_tpu.train.optimizers import dense_optimizer, sparse_optimizer

# Memory the planner keeps free for activations and dense parameters (its default percentage).
STORAGE_RESERVED_FRACTION = 0.15


def shard_model(model: nn.Module, env: DistEnv, device: torch.device, optim: OptimConfig,
                global_batch: int) -> DistributedModelParallel:
    """Attach ``optim``'s fused embedding optimizer, plan the tables over the world for
    ``global_batch`` (``--batch-size``; TorchRec's planner gets each rank's share), and shard."""
    sparse = sparse_optimizer(optim.sparse_optimizer)
    collections = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
    embedding_params = [p for ebc in collections for p in ebc.parameters()]
    if not embedding_params:
        raise ValueError("model has no embedding tables (no EmbeddingBagCollection parameters)")
    apply_optimizer_in_backward(sparse.torch_class(), embedding_params, {"lr": optim.sparse_lr})
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=env.world_size, local_world_size=env.local_world_size),
        kernel_config=KernelConfig(compute_device=device.type),
    )
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=env.local_batch_of(global_batch),
        storage_reservation=FixedPercentageStorageReservation(STORAGE_RESERVED_FRACTION),
    )
    plan = planner.collective_plan(model, pg=dist.GroupMember.WORLD)
    return DistributedModelParallel(module=model, device=device, plan=plan)


def build_optimizer(model: DistributedModelParallel, optim: OptimConfig) -> CombinedOptimizer:
    """The fused embedding optimizer plus ``optim``'s dense optimizer over every other parameter."""
    dense = dense_optimizer(optim.dense_optimizer)

    def make(params: list) -> torch.optim.Optimizer:
        return dense.build(params, optim.dense_lr)

    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    return CombinedOptimizer([model.fused_optimizer, KeyedOptimizerWrapper(dense_params, make)])


@dataclass(frozen=True)
class TorchRecEngine:
    """The :class:`~torchrec_tpu.train.engines.Engine` of stock TorchRec: DMP over FBGEMM's fused
    TBE, planned by TorchRec's own planner, dense part in DMP's DDP on ``device``; ``optim``'s
    optimizers, ``global_batch`` (``--batch-size``)."""

    optim: OptimConfig
    global_batch: int
    name = "torchrec"
    needs_device_tensors = False  # towers and tables on the host

    @classmethod
    def from_config(cls, config: TrainConfig) -> TorchRecEngine:
        return cls(config.optim, config.data.batch_size)

    def step_layout(self, spec: ModelSpec, env: DistEnv) -> StepLayout:
        return torchrec_layout(self.optim, env.world_size)

    def build_model(self, spec: ModelSpec, env: DistEnv, device: torch.device, layout: StepLayout) -> nn.Module:
        return shard_model(build_dlrm(spec, dense_device=device), env, device, self.optim, self.global_batch)

    def build_optimizer(self, model: nn.Module, layout: StepLayout) -> CombinedOptimizer:
        return build_optimizer(model, self.optim)  # type: ignore[arg-type]

    def wrap_batches(self, batches: Iterable[Batch], model: nn.Module, env: DistEnv, device: torch.device,
                     background: bool = True) -> Iterable[Batch]:
        """Several ranks agree on every batch (a failing or exhausted reader stops all at once)."""
        return AgreedBatches(batches, None, env.rank, env.world_size) if env.world_size > 1 else batches

    def step_function(self, model: nn.Module, optimizer: torch.optim.Optimizer, layout: StepLayout) -> StepFn:
        return eager_train_step("cpu", layout.precision)  # --precision bf16: CPU torch's bf16 autocast

    def eval_forward(self, model: nn.Module, layout: StepLayout) -> EvalForward:
        return eager_eval_forward("cpu", layout.precision)

    def sharding_plan(self, model: nn.Module) -> str:
        """TorchRec's own text of the DMP's plan (per module: each table's sharding type, compute
        kernel and ranks)."""
        return f"sharding plan (TorchRec planner)\n{model.plan}"

    def learning_rates(self, policy: LRPolicy, model: nn.Module, optimizer: torch.optim.Optimizer) -> LearningRates:
        """Over the dense groups and the fused embedding optimizer's (pushed to FBGEMM before each
        backward)."""
        fused = model.fused_optimizer  # type: ignore[union-attr]
        sparse = list(fused.param_groups)
        dense = [g for g in optimizer.param_groups if all(g is not s for s in sparse)]
        return LearningRates(policy, dense, self.optim.dense_lr, sparse, self.optim.sparse_lr, fused.step)
