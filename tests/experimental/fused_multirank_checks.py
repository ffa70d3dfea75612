"""Rank body of the multi-rank fused EBC test: on each rank of a tpu_dist world of D ranks,
``SparseCoreFusedEmbeddingBagCollection(global_device_count=D)`` (tables DTensor ``Shard(0)``) fed
its own samples equals one CPU TorchRec EmbeddingBagCollection + torch.optim over the global batch,
forward and three fused steps; then the ranks save a DCP checkpoint with ``SparseCoreSavePlanner``."""

from __future__ import annotations

import datetime
import traceback
from typing import Any

import torch
import torch.distributed as dist

BATCH = 8  # samples per rank
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1}),
              "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}),
              "adam": (torch.optim.Adam, {"lr": 0.05})}


def _ids(world: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Per feature, each global sample's ids (0-3, repeats included)."""
    g = torch.Generator().manual_seed(seed)
    return {f: [torch.randint(0, 20, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g)
                for _ in range(world * BATCH)] for f in ("fa", "fa2", "fb")}


def _kjt(ids: dict[str, list[torch.Tensor]], lo: int, hi: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = list(ids)
    return KeyedJaggedTensor(keys=keys, values=torch.cat([torch.cat(ids[k][lo:hi]) for k in keys]).long(),
                             lengths=torch.tensor([len(x) for k in keys for x in ids[k][lo:hi]]))


def rank_body(rank: int, world: int, store: dist.Store, timeout: datetime.timedelta, optimizer: str,
              checkpoint_dir: str) -> tuple[str, dict[str, torch.Tensor]]:
    """("ok" or the traceback, the module's trained logical tables), the checkpoint saved in
    ``checkpoint_dir``."""
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=world, timeout=timeout)
    import torch_tpu  # noqa: F401  (the device, the ops) after the group: it joins jax.distributed

    tables: dict[str, torch.Tensor] = {}
    try:
        tables = _check(rank, world, optimizer, checkpoint_dir)
        result = "ok"
    except Exception:  # noqa: BLE001 -- reported to the parent
        result = traceback.format_exc()
    dist.destroy_process_group()
    return result, tables


def _check(rank: int, world: int, optimizer: str, checkpoint_dir: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_tpu.experimental import (
        SparseCoreEmbeddingConfig,
        SparseCoreFusedEmbeddingBagCollection,
        SparseCoreInputPreprocessor,
        SparseCoreSavePlanner,
    )

    optimizer_type, kwargs = OPTIMIZERS[optimizer]
    configs = table_configs()
    tables = [SparseCoreEmbeddingConfig(c) for c in configs]
    fused = SparseCoreFusedEmbeddingBagCollection(tables, optimizer_type, kwargs, batch_size=BATCH,
                                                  global_device_count=world)
    assert all(isinstance(w, DTensor) for w in fused.table_weights.values())
    torch.manual_seed(0)
    stock = EmbeddingBagCollection(tables=configs)
    fused.set_unstacked_table_weights({n: m.weight for n, m in stock.embedding_bags.items()})
    stock_optimizer = optimizer_type(stock.parameters(), **kwargs)
    preprocessor = SparseCoreInputPreprocessor(tables, batch_size=BATCH, global_device_count=world)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for step in range(3):
        ids = _ids(world, 0 if optimizer == "adam" else step)  # lazy Adam equals torch's on a repeated batch
        expected = stock(_kjt(ids, 0, world * BATCH)).values()
        got = fused(preprocessor(_kjt(ids, mine.start, mine.stop)).to("tpu"))
        torch.testing.assert_close(got.values().cpu(), expected[mine].detach(), rtol=1e-5, atol=1e-6)
        grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(100 + step))
        (got.values() * grad[mine].to("tpu")).sum().backward()
        stock_optimizer.zero_grad()
        (expected * grad).sum().backward()
        stock_optimizer.step()
        for name, value in fused.get_unstacked_table_weights().items():
            torch.testing.assert_close(value, stock.embedding_bags[name].weight.detach(), rtol=1e-5, atol=1e-6)
    dcp.save(fused.state_dict(), checkpoint_id=checkpoint_dir, planner=SparseCoreSavePlanner(num_sc_per_device=2))
    return fused.get_unstacked_table_weights()


def table_configs() -> list[Any]:
    """The two tables: "ta" with two features, "tb" MEAN-pooled."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    return [EmbeddingBagConfig(name="ta", num_embeddings=100, embedding_dim=8, feature_names=["fa", "fa2"]),
            EmbeddingBagConfig(name="tb", num_embeddings=40, embedding_dim=8, feature_names=["fb"],
                               pooling=PoolingType.MEAN)]
