"""Rank body of the stock-DMP test: TorchRec's ``DLRM_DCN`` with its ``EmbeddingBagCollection``
column-wise sharded on the ``UNFUSED_TPU`` compute kernel under ``DistributedModelParallel`` over
``tpu_dist`` (the path of TorchRec's MLPerf DLRM-v2 TPU benchmark, at small cardinalities), trained
with one ``torch.optim.Adagrad`` over every parameter, against the same model on CPU over the global
batch. Each rank's loss is the mean over its own samples: the dense gradients are averaged over the
ranks (DDP), the tables' gradients add every rank's (the embedding all-to-all's backward)."""

from __future__ import annotations

import datetime
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

BATCH = 4  # samples per rank
DIM = 32
ROWS = [50, 30, 20]
MULTI_HOT = [2, 1, 3]
DENSE_IN = 4
STEPS = 2
LR = 0.05


def _tables() -> list[Any]:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{i}"])
            for i, rows in enumerate(ROWS)]


def _model(device: torch.device) -> Any:
    from torchrec.models.dlrm import DLRM_DCN
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(tables=_tables(), device=torch.device("meta") if device.type == "tpu" else device)
    return DLRM_DCN(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=[16, DIM],
                    over_arch_layer_sizes=[16, 1], dcn_num_layers=2, dcn_low_rank_dim=8, dense_device=device)


def global_batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]:
    """Per step: dense features, labels, and per feature the ids (MULTI_HOT per sample)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        dense = torch.randn(world * BATCH, DENSE_IN, generator=g)
        labels = torch.randint(0, 2, (world * BATCH, 1), generator=g).float()
        out.append((dense, labels, [torch.randint(0, rows, (world * BATCH, hot), generator=g)
                                    for rows, hot in zip(ROWS, MULTI_HOT)]))
    return out


def _kjt(ids: list[torch.Tensor], lo: int, hi: int) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(ROWS))], values=torch.cat([x[lo:hi].reshape(-1) for x in ids]),
        lengths=torch.cat([torch.full((hi - lo,), hot) for hot in MULTI_HOT]))


def reference(world: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Per step each rank's loss, and the final state, of the CPU model."""
    torch.manual_seed(0)
    model = _model(torch.device("cpu"))
    tables = {n: p for n, p in model.named_parameters() if "embedding_bags" in n}
    dense = {n: p for n, p in model.named_parameters() if n not in tables}
    optimizer = torch.optim.Adagrad(model.parameters(), lr=LR)
    losses = []
    for x, y, ids in global_batches(world):
        logits = model(x, _kjt(ids, 0, world * BATCH))
        per_rank = [F.binary_cross_entropy_with_logits(logits[r * BATCH:(r + 1) * BATCH], y[r * BATCH:(r + 1) * BATCH])
                    for r in range(world)]
        optimizer.zero_grad()
        table_grads = torch.autograd.grad(sum(per_rank), list(tables.values()), retain_graph=True)
        dense_grads = torch.autograd.grad(sum(per_rank) / world, list(dense.values()))
        for p, grad in zip([*tables.values(), *dense.values()], [*table_grads, *dense_grads]):
            p.grad = grad
        optimizer.step()
        losses.append([float(loss.detach()) for loss in per_rank])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in _model(torch.device("cpu")).state_dict().items()}


def _dmp(model: Any, world: int, device: torch.device) -> Any:
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.experimental.torch_tpu.pallas import dispatcher, impl  # noqa: F401  (TorchRec's TPU kernels)

    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        model.sparse_arch.embedding_bag_collection,
        per_param_sharding={t.name: column_wise(ranks=list(range(world)),
                                                compute_kernel=EmbeddingComputeKernel.UNFUSED_TPU.value)
                            for t in _tables()},
        sharder=EmbeddingBagCollectionSharder(), local_size=1, world_size=world, device_type="tpu")})
    # DMP's default DDP wrapper uses a static graph, whose C++ reducer asks PrivateUse1 for a pinned-memory
    # allocator: torch 2.13 lets a Python backend register no such hook, so the dense part is plain DDP
    return DistributedModelParallel(module=model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                                    plan=plan, sharders=[EmbeddingBagCollectionSharder()],
                                    data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=False))


def _train(rank: int, world: int) -> tuple[list[float], dict[str, Any]]:
    device = torch.device("tpu")
    dmp = _dmp(_model(device), world, device)
    _load_full_state(dmp.state_dict(), initial_state())
    # TorchRec 1.9.2's UNFUSED_TPU kernels leave their table weights out of dmp.parameters()
    # (test_unfused_parameters.py): the optimizer takes them as well, as a user's must
    tables = [p for module in dmp.modules() for lookup in getattr(module, "_lookups", []) for p in lookup.parameters()]
    assert tables, "no UNFUSED_TPU lookup weights found"
    optimizer = torch.optim.Adagrad([*dmp.parameters(), *tables], lr=LR)
    losses = []
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for x, y, ids in global_batches(world):
        kjt = _kjt(ids, mine.start, mine.stop).to(device)
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(dmp(x[mine].to(device), kjt), y[mine].to(device))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach().cpu()))
    state = {}
    for key, value in dmp.state_dict().items():
        if hasattr(value, "local_shards"):  # a column block of a table: (its column offset, its values)
            shard = value.local_shards()[0]
            state[key] = (shard.metadata.shard_offsets[1], shard.tensor.detach().cpu())
        else:
            state[key] = (None, value.detach().cpu())
    return losses, state


def _load_full_state(sharded: dict[str, Any], full: dict[str, torch.Tensor]) -> None:
    """Copy a full CPU state into a DMP state dict: each local shard gets its block of the table."""
    with torch.no_grad():
        for key, target in sharded.items():
            if hasattr(target, "local_shards"):
                for shard in target.local_shards():
                    (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(full[key][r:r + h, c:c + w].to(shard.tensor.device))
            else:
                target.copy_(full[key].to(target.device))


def rank_body(rank: int, world: int, store: dist.Store, timeout: datetime.timedelta) -> tuple[str, Any]:
    """("ok" or the traceback, (this rank's losses, its state: key -> (column offset or None, values)))."""
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=world, timeout=timeout)
    import torch_tpu  # noqa: F401  (the device, after the group: it joins jax.distributed)

    result: Any = None
    try:
        result, status = _train(rank, world), "ok"
    except Exception:  # noqa: BLE001 -- reported to the parent
        status = traceback.format_exc()
    dist.destroy_process_group()
    return status, result


def unseeded_losses(rank: int, world: int, store: dist.Store, timeout: datetime.timedelta) -> list[float]:
    """This rank's loss per step in the way of TorchRec's MLPerf DLRM-v2 TPU script, which seeds
    nothing: DCN weights drawn on the CPU at construction, dense features and labels drawn on the
    device, ids from a seeded generator, ``Adagrad(foreach=True)`` over ``dmp.parameters()``."""
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=world, timeout=timeout)
    import torch_tpu  # noqa: F401

    device = torch.device("tpu")
    dmp = _dmp(_model(device), world, device)
    dense = torch.randn(BATCH, DENSE_IN, device=device)
    labels = (torch.rand(BATCH, 1, device=device) > 0.5).float()
    optimizer = torch.optim.Adagrad(dmp.parameters(), lr=LR, foreach=True)
    losses = []
    for _, _, ids in global_batches(world):
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(dmp(dense, _kjt(ids, rank * BATCH, (rank + 1) * BATCH).to(device)),
                                                  labels)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach().cpu()))
    dist.destroy_process_group()
    return losses
