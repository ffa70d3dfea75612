"""TorchRec 1.9.2's ``SparseCoreTrainPipeline`` fed by its ``PrefetchDataLoader`` on ``world``
tpu_dist ranks (one tpu device each), against the same 3-stage schedule computed by hand with stock
TorchRec on CPU; then a DCP save with ``SparseCoreSavePlanner``.

The pipeline overlaps SparseCore forward of batch k+2, dense forward/backward of batch k+1 and the
fused SparseCore update of batch k: batch k looks up tables updated through batch k-2, the dense
layers step every batch. Each rank trains on its own samples: dense gradients are averaged over the
ranks, the table update adds every rank's samples' gradients (the SparseCore op spans the devices).
:func:`reference_training` applies exactly that schedule to a stock ``EmbeddingBagCollection``.
"""

from __future__ import annotations

import datetime
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.torchrec_192.reference import bag_configs, ids_per_sample, kjt, load_logical_tables, logical_tables

BATCH = 8  # samples per rank
STEPS = 5
DENSE = 4
LR = 0.1


class TinyRec(nn.Module):
    """Dense features and the pooled embeddings (in key order) through one linear layer."""

    def __init__(self, embedding_layer: nn.Module, width: int) -> None:
        super().__init__()
        self.embedding_layer = embedding_layer
        self.over = nn.Linear(DENSE + width, 1)

    def dense_forward(self, embeddings: Any, dense_features: torch.Tensor) -> torch.Tensor:
        pooled = embeddings.to_dict()
        return self.over(torch.cat([dense_features, *(pooled[k] for k in sorted(pooled))], dim=1)).squeeze(1)


def batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, list[torch.Tensor]]]]:
    """Per step, the global batch: dense features, labels, ids per feature and sample."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(world * BATCH, DENSE, generator=g), torch.randint(0, 2, (world * BATCH,), generator=g).float(),
             ids_per_sample(bag_configs(), world * BATCH, seed=step)) for step in range(STEPS)]


def initial_state() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The logical tables and the dense layer every run starts from."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    stock = EmbeddingBagCollection(tables=bag_configs())
    over = nn.Linear(DENSE + sum(c.embedding_dim * len(c.feature_names) for c in bag_configs()), 1)
    return ({n: m.weight.detach().clone() for n, m in stock.embedding_bags.items()},
            {k: v.detach().clone() for k, v in over.state_dict().items()})


def reference_training(world: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses (mean over ranks, per batch), tables and dense layer of the pipeline's schedule, on CPU."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables, dense = initial_state()
    stock = EmbeddingBagCollection(tables=bag_configs())
    stock.load_state_dict({f"embedding_bags.{n}.weight": w for n, w in tables.items()})
    model = TinyRec(stock, 0)
    model.over = nn.Linear(DENSE + sum(c.embedding_dim * len(c.feature_names) for c in bag_configs()), 1)
    model.over.load_state_dict(dense)
    weights = [m.weight for m in stock.embedding_bags.values()]
    criterion = nn.BCEWithLogitsLoss()
    pending: list[list[torch.Tensor]] = []
    losses = []
    for k, (dense_x, labels, ids) in enumerate(batches(world)):
        if k >= 2:
            _sgd(weights, pending[k - 2])
        logits = model.dense_forward(stock(kjt(ids)), dense_x)
        per_rank = [criterion(logits[r * BATCH:(r + 1) * BATCH], labels[r * BATCH:(r + 1) * BATCH])
                    for r in range(world)]
        pending.append(list(torch.autograd.grad(sum(per_rank), weights, retain_graph=True)))
        dense_grads = torch.autograd.grad(sum(per_rank) / world, list(model.over.parameters()))
        _sgd(list(model.over.parameters()), dense_grads)
        losses.append(float(sum(per_rank).detach()) / world)
    for grads in pending[-2:]:
        _sgd(weights, grads)
    return losses, {n: m.weight.detach() for n, m in stock.embedding_bags.items()}, model.over.state_dict()


def _sgd(params: list[torch.Tensor], grads: Any) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= LR * g


def pipeline_training(rank: int, world: int, checkpoint_dir: str | None,
                      ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's pipeline run: losses (mean over ranks), trained tables, dense layer."""
    import torch.distributed.checkpoint as dcp
    from torchrec.experimental.torch_tpu import (
        PrefetchDataLoader,
        SparseCoreFusedEmbeddingBagCollection,
        SparseCoreInputPreprocessor,
        SparseCoreSavePlanner,
        SparseCoreTrainPipeline,
    )

    from tests.torchrec_192.reference import sc_tables

    tables_init, dense_init = initial_state()
    tables = sc_tables(bag_configs(), {"ta": "s", "tc": "s"})
    layer = SparseCoreFusedEmbeddingBagCollection(tables=tables, optimizer_type=torch.optim.SGD,
                                                  optimizer_kwargs={"lr": LR}, batch_size=BATCH,
                                                  global_device_count=world)
    load_logical_tables(layer, tables_init)
    model = TinyRec(layer, sum(c.embedding_dim * len(c.feature_names) for c in bag_configs()))
    model.over.load_state_dict(dense_init)
    model.over.to("tpu")
    dense_optimizer = torch.optim.SGD(model.over.parameters(), lr=LR)
    pipeline = SparseCoreTrainPipeline(model, dense_optimizer, nn.BCEWithLogitsLoss(), compile=False)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    local = [(x[mine], y[mine], kjt(ids, mine.start, mine.stop)) for x, y, ids in batches(world)]
    preprocessor = SparseCoreInputPreprocessor(tables=tables, batch_size=BATCH, global_device_count=world)
    losses = []
    with PrefetchDataLoader(local, preprocessor, torch.device("tpu")) as loader:
        for loss in pipeline.iterate(loader):
            value = loss.detach().cpu()
            if world > 1:
                dist.all_reduce(value)
            losses.append(float(value) / world)
    # the pipeline updates its own copies of the tables (functional SparseCore backward); the
    # module's parameters keep their initial values, so the trained tables go back in for the save
    trained = logical_tables(layer, pipeline._embedding_tables)
    load_logical_tables(layer, trained)
    if checkpoint_dir is not None:
        dcp.save(layer.state_dict(), checkpoint_id=checkpoint_dir,
                 planner=SparseCoreSavePlanner(num_sc_per_device=2, stacked_configs=layer.stacked_configs))
    return losses, trained, {k: v.detach().cpu() for k, v in model.over.state_dict().items()}


def rank_body(rank: int, world: int, store: dist.Store, timeout: datetime.timedelta, checkpoint_dir: str,
              ) -> tuple[str, Any]:
    """("ok" or the traceback, this rank's :func:`pipeline_training` result)."""
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=world, timeout=timeout)
    import torch_tpu  # noqa: F401  (the device, after the group: it joins jax.distributed)

    result: Any = None
    try:
        result, status = pipeline_training(rank, world, checkpoint_dir), "ok"
    except Exception:  # noqa: BLE001 -- reported to the parent
        status = traceback.format_exc()
    dist.destroy_process_group()
    return status, result
