"""Rank body of the dense-placement tests: the sparsecore DLRM trained a few steps on fixed
batches, with its dense towers on a given device and synced a given way.

Every rank trains on its slice of the same global batches from the same init; with the EBC and
DDP / FSDP2 averaging over ranks, W ranks train like one rank on the whole batch.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_tpu.sharding import ShardedSparseCoreEBC
from torchrec_tpu.train.config import EngineConfig, OptimConfig
from torchrec_tpu.train.distributed import process_group
from torchrec_tpu.train.engines.dense_placement import dense_device
from torchrec_tpu.train.engines.dense_step import CompiledDenseEval, CompiledDenseStep, eval_forward, step_function
from torchrec_tpu.train.engines.sparsecore_engine import EBC_PATH, build_dense_optimizer, build_sparsecore_model
from torchrec_tpu.train.engines.step_layout import sparsecore_layout
from torchrec_tpu.train.metrics import evaluate
from torchrec_tpu.train.model import ModelSpec

STEPS = 4
OPTIM = OptimConfig(sparse_optimizer="adagrad", sparse_lr=0.1, dense_optimizer="adagrad", dense_lr=0.05)
GLOBAL_BATCH = 32
FEATURES = ("f0", "f1", "f2")
TABLE_SIZES = (40, 30, 20)


def spec(model: str) -> ModelSpec:
    dcn = model == "dlrm_dcn"
    return ModelSpec(feature_names=FEATURES, table_sizes=TABLE_SIZES, embedding_dim=8, dense_in_features=13,
                     dense_layers=(16, 8), over_layers=(16, 1), dcn_num_layers=2 if dcn else 0,
                     dcn_low_rank_dim=4 if dcn else 0)


def global_batch(step: int, size: int = GLOBAL_BATCH) -> Batch:
    """Multi-hot ids (0..3 per sample and feature), dense features, labels with some signal."""
    g = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(0, 4, (len(FEATURES), size), generator=g)
    values = torch.cat([torch.randint(0, rows, (int(n),), generator=g)
                        for rows, n in zip(TABLE_SIZES, lengths.sum(dim=1))])
    dense = torch.randn(size, 13, generator=g)
    labels = (dense[:, 0] + 0.5 * torch.randn(size, generator=g) > 0).float()
    kjt = KeyedJaggedTensor.from_lengths_sync(list(FEATURES), values, lengths.reshape(-1))
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def rank_slice(batch: Batch, rank: int, world: int) -> Batch:
    """Samples ``rank * B/W .. (rank+1) * B/W`` of ``batch``."""
    size = batch.labels.numel()
    rows = size // world
    lo, hi = rank * rows, (rank + 1) * rows
    kjt = batch.sparse_features
    lengths = kjt.lengths().view(len(FEATURES), size)
    values = torch.cat([jt.values()[int(jt.lengths()[:lo].sum()):int(jt.lengths()[:hi].sum())]
                        for jt in kjt.to_dict().values()])
    sliced = KeyedJaggedTensor.from_lengths_sync(list(FEATURES), values, lengths[:, lo:hi].reshape(-1))
    return Batch(dense_features=batch.dense_features[lo:hi], sparse_features=sliced, labels=batch.labels[lo:hi])


def train(device_name: str, parallel: str = "ddp", model: str = "dlrm", prefetch: bool = False,
          sparse_backend: str = "ops") -> dict:
    """Train STEPS steps in the current process group (or a fresh world of 1); returns per-step
    losses, the held-out evaluation and every parameter / table on the host (full, unsharded).
    ``prefetch``: each batch's input dist runs ahead, as in the job's pipeline (else in the step);
    ``sparse_backend``: the EBC's (``ops``: the one a step program calls itself)."""
    with process_group() as env:
        device = dense_device(device_name)
        torch.manual_seed(0)  # the dense towers' init
        engine = EngineConfig(dense_parallel=parallel, sparse_backend=sparse_backend)
        layout = sparsecore_layout(engine, OPTIM, env.world_size, GLOBAL_BATCH // env.world_size, device)
        net = build_sparsecore_model(spec(model), env, layout, OPTIM, engine, GLOBAL_BATCH, seed=0)
        optimizer = build_dense_optimizer(net, OPTIM, layout.dense_device)
        initial = _host_state(net)
        losses = []
        step_fn = step_function(net, optimizer, layout)  # as the job does
        for step in range(STEPS):
            batch = rank_slice(global_batch(step), env.rank, env.world_size)
            if prefetch:
                ebc = next(m for m in net.modules() if isinstance(m, ShardedSparseCoreEBC))
                batch = Batch(batch.dense_features, ebc.prefetch(batch.sparse_features), batch.labels)
            losses.append(float(step_fn(net, optimizer, batch)))
        # a larger batch than training's (as the job's evaluation batches) and a smaller last one
        sizes = (GLOBAL_BATCH, 2 * GLOBAL_BATCH + GLOBAL_BATCH // 2, GLOBAL_BATCH // 2)
        held_out = [rank_slice(global_batch(STEPS + i, size), env.rank, env.world_size) for i, size in enumerate(sizes)]
        forward = eval_forward(net, layout)  # as the job does
        result = evaluate(net, held_out, torch.device("cpu"), forward)
        eager = evaluate(net, held_out, torch.device("cpu"))
        return {"losses": losses, "auc": result.auc, "eval_loss": result.loss, "initial": initial,
                "eager_auc": eager.auc, "eager_eval_loss": eager.loss,
                "compiled_eval": isinstance(forward, CompiledDenseEval),
                "one_program_eval": getattr(forward, "one_program_batches", 0),
                "state": _host_state(net), "devices": {p.device.type for p in net.parameters() if p.numel()},
                "compiled_steps": _calls(step_fn, "step") + _calls(step_fn, "fused_step"),
                "fused_steps": _calls(step_fn, "fused_step")}


def _calls(step_fn: object, program: str) -> int:
    """Steps the compiled dense step ran as ``program`` (``step``: towers only; ``fused_step``:
    lookup, towers and embedding update)."""
    step = getattr(step_fn, program, None) if isinstance(step_fn, CompiledDenseStep) else None
    return step.stats.calls if step is not None else 0


def _host_state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every dense parameter (by name) and embedding table (``table.<name>``), full, on the host."""
    ebc = next(m for m in net.modules() if isinstance(m, ShardedSparseCoreEBC))
    out = {name: _full(value) for name, value in net.state_dict().items() if not name.startswith(EBC_PATH)}
    out.update({f"table.{name}": w for name, w in ebc.unsharded_weights().items()})
    return out


def _full(value: torch.Tensor) -> torch.Tensor:
    """A host copy of ``value``, gathered if it is an FSDP2 shard (a collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().cpu().clone()


def rank_body(rank: int, world: int, store: dist.Store, timeout: datetime.timedelta, device_name: str,
              parallel: str, model: str, prefetch: bool = False) -> dict:
    """``launch_local`` entry: join a tpu_dist world over ``store`` (before the device is used,
    so its tpu tensors get the XLA transport) and train; the result names the transport."""
    import torch_tpu.distributed as tpu_dist

    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        return {**train(device_name, parallel, model, prefetch), "transport": tpu_dist.active_transport()}
    finally:
        dist.destroy_process_group()
