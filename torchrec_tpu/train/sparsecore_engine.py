"""``--engine sparsecore``: the stock TorchRec DLRM with its EmbeddingBagCollection replaced by
:class:`ShardedSparseCoreEBC` (fused sparse optimizer in backward), dense part in DDP.

The dense towers run on ``device`` (CPU today); their optimizer is keyed by parameter name, like
the torchrec engine's, so checkpoints have the same shape of state.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.datasets.utils import Batch
from torchrec.optim.keyed import KeyedOptimizerWrapper

from sparsecore import SGD, Adagrad, OptimizerSpec, RowWiseAdagrad
from sparsecore.torchrec_convert import specs_from_configs
from torchrec_tpu.pipeline import PrefetchedBatches
from torchrec_tpu.sharding import ShardedSparseCoreEBC
from torchrec_tpu.train.distributed import DistEnv
from torchrec_tpu.train.model import ModelSpec, build_dlrm
from torchrec_tpu.train.plan_loading import resolve_sharding
from torchrec_tpu.train.sharding import DENSE_OPTIMIZER_CLASSES

EBC_PATH = "model.sparse_arch.embedding_bag_collection"
PIPELINE_DEPTH = 2  # batches whose input dist runs ahead of the training step


def sparse_optimizer_spec(name: str, lr: float) -> OptimizerSpec:
    """The sparsecore optimizer doing what the torchrec engine's FBGEMM fused optimizer does
    (accumulators start at 0, FBGEMM's default eps 1e-8)."""
    specs = {
        "sgd": lambda: SGD(lr),
        "adagrad": lambda: Adagrad(lr, initial_accumulator_value=0.0, eps=1e-8),
        "rowwise_adagrad": lambda: RowWiseAdagrad(lr, initial_accumulator_value=0.0, eps=1e-8),
    }
    if name not in specs:
        raise ValueError(f"sparse optimizer {name!r} is not one of {list(specs)}")
    return specs[name]()


def build_sparsecore_model(spec: ModelSpec, env: DistEnv, device: torch.device, sparse_optimizer: str,
                           sparse_lr: float, batch_size: int, seed: int, plan: str | None = None) -> nn.Module:
    """DLRMTrain whose embeddings are sharded over the world on sparsecore (xla backend) as ``plan``
    says (see :func:`~torchrec_tpu.train.plan_loading.resolve_sharding`)."""
    model = build_dlrm(spec, dense_device=device)
    arch = model.model.sparse_arch
    local_batch = max(1, batch_size // env.world_size)
    tables_ebc = arch.embedding_bag_collection
    optimizer = sparse_optimizer_spec(sparse_optimizer, sparse_lr)
    tables, _ = specs_from_configs(tables_ebc.embedding_bag_configs(), local_batch, optimizer=optimizer)
    arch.embedding_bag_collection = ShardedSparseCoreEBC.from_torchrec(
        tables_ebc, local_batch, resolve_sharding(plan, tables, env.world_size, batch_size), optimizer,
        seed=seed, average_over_ranks=True,
    )
    if env.world_size == 1:
        return model
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, [name for name, _ in model.named_parameters() if name.startswith(EBC_PATH)])
    return DenseDDP(model)


class DenseDDP(DistributedDataParallel):
    """DDP whose state dict is the wrapped model's (no ``module.`` prefix), so checkpoints of any
    world size load into any other, and into the unwrapped 1-rank model."""

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def pipelined(batches: Iterable[Batch], model: nn.Module, env: DistEnv, device: torch.device,
              depth: int = PIPELINE_DEPTH) -> PrefetchedBatches:
    """``batches`` with their input dist run ``depth`` batches ahead on a background thread (over
    a process group of its own when there are several ranks; a collective: call on every rank)."""
    ebc = _unwrap(model).model.sparse_arch.embedding_bag_collection
    group = dist.new_group() if env.world_size > 1 else None
    return PrefetchedBatches(batches, ebc, device, depth, group)


def build_dense_optimizer(model: nn.Module, dense_optimizer: str, dense_lr: float) -> KeyedOptimizerWrapper:
    """``dense_optimizer`` over every parameter outside the sparsecore EBC, keyed by its name in
    the unwrapped model (the same at every world size)."""
    if dense_optimizer not in DENSE_OPTIMIZER_CLASSES:
        raise ValueError(f"dense optimizer {dense_optimizer!r} is not one of {list(DENSE_OPTIMIZER_CLASSES)}")
    cls = DENSE_OPTIMIZER_CLASSES[dense_optimizer]
    params = {name: p for name, p in _unwrap(model).named_parameters() if not name.startswith(EBC_PATH)}
    return KeyedOptimizerWrapper(params, lambda ps: cls(ps, lr=dense_lr))
